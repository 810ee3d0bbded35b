// What a first write costs a MiB on this machine: private anonymous memory on 4 KiB pages and on
// transparent huge pages, and POSIX shared memory (the shm backend's buckets) touched page by page,
// after MAP_POPULATE, and after MADV_POPULATE_WRITE, by its creator and by a second mapping (a peer).
//   gcc -O2 -o /tmp/page_costs bench/results/shm_prefault/page_costs.c && /tmp/page_costs 128
// 2026-12-05, twelfth session, the Zen 5 VM (outputs in page_costs.txt beside this file).
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static void touch(char* p, size_t n) {
  for (size_t i = 0; i < n; i += 4096) p[i] = 1;
}

static void private_memory(size_t n, int huge) {
  const size_t al = 2 << 20;
  char* m = mmap(0, n + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char* q = (char*)(((size_t)m + al - 1) & ~(al - 1));
  if (huge) madvise(q, n, MADV_HUGEPAGE);
  double t = now();
  touch(q, n);
  printf("private, %s: %.3f ms a MiB\n", huge ? "MADV_HUGEPAGE" : "4 KiB pages", (now() - t) * 1e3 / (n >> 20));
  munmap(m, n + al);
}

static char* map_shared(int fd, size_t n, int how) {
  char* q = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED | (how == 1 ? MAP_POPULATE : 0), fd, 0);
  if (how == 2) madvise(q, n, MADV_POPULATE_WRITE);
  return q;
}

static void shared_memory(size_t n, int how) {
  static const char* names[] = {"touched page by page", "MAP_POPULATE, then touched", "MADV_POPULATE_WRITE, then touched"};
  int fd = shm_open("/page_costs_probe", O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (ftruncate(fd, (off_t)n) != 0) exit(1);
  double t = now();
  char* q = map_shared(fd, n, how);
  touch(q, n);
  double t1 = now();
  char* r = map_shared(fd, n, how);
  touch(r, n);
  double t2 = now();
  printf("shared, %s: creator %.3f ms a MiB, a second mapping %.3f\n", names[how], (t1 - t) * 1e3 / (n >> 20), (t2 - t1) * 1e3 / (n >> 20));
  munmap(q, n);
  munmap(r, n);
  close(fd);
  shm_unlink("/page_costs_probe");
}

int main(int argc, char** argv) {
  const size_t n = (size_t)(argc > 1 ? atoi(argv[1]) : 128) << 20;
  for (int round = 0; round < 2; ++round) {
    private_memory(n, 0);
    private_memory(n, 1);
    for (int how = 0; how < 3; ++how) shared_memory(n, how);
  }
  return 0;
}
