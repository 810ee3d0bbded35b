// The one doctest main of every suite.
//
// Note [A filter that matches nothing fails]
// ctest runs each scenario as `suite --test-case=<its name>` (doctest_discover_tests). A name that
// reaches ctest cut (CMake's list splitting cuts names at ';', and 57 scenarios had one) makes a
// filter that matches no scenario, and doctest passes a run that ran nothing: those scenarios never
// ran in CI, and a test that cannot fail is worse than none. So here a run given a --test-case
// filter that matched no scenario fails, naming the filter.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

namespace {

unsigned matched = 0;  // scenarios that passed the filters in the last run

struct CountMatched : doctest::IReporter {
  explicit CountMatched(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override { matched = stats.numTestCasesPassingFilters; }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
DOCTEST_REGISTER_LISTENER("count_matched", 1, CountMatched);

}  // namespace

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --help, --list-test-cases, ...
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    for (const char* flag : {"--test-case=", "-tc="})
      if (a.rfind(flag, 0) == 0) filter = a.substr(std::string(flag).size());
  }
  if (rc == 0 && !filter.empty() && matched == 0) {
    std::fprintf(stderr, "%s: the filter --test-case='%s' matched no scenario (a scenario's name cut short on its way to ctest? "
                 "A ';' in a name does that: Note [A filter that matches nothing fails])\n", argv[0], filter.c_str());
    return 1;
  }
  return rc;
}
