# Thin wrapper over CMake: the README's quick start is `make demo` and `make test`.
BUILD   ?= build
JOBS    ?= 2
CMAKE_FLAGS ?=
SHARDFLOW_CUDA ?= AUTO
PREFIX  ?= /usr/local

.PHONY: all deps configure build demo test bench install clean

all: build

deps:
	@bash scripts/install_deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDFLOW_CUDA=$(SHARDFLOW_CUDA) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# Two ranks (threads of one process, in-process collectives) train an MLP classifier on
# scikit-learn's handwritten digits (1,437 training images, 360 held out) data-parallel with ZeRO-1:
# each rank keeps half of AdamW's state and steps its buckets as their reductions land. It ends
# with the accuracy on the held-out images (a linear model gets 96.1% of them).
demo: build
	$(BUILD)/examples/mlp_train --data $(BUILD)/data/digits.safetensors --loss cross-entropy \
	  --sizes 64,256,256,10 --steps 600 --global-batch 64 --world-size 2 --optimizer adamw --lr 1e-3 \
	  --seed 1 --zero-stage 1 --overlap interleaved

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

bench: build
	$(BUILD)/bench/bench_collectives
	$(BUILD)/bench/bench_ddp
	$(BUILD)/bench/bench_zero
	$(BUILD)/bench/bench_overlap
	$(BUILD)/bench/bench_overhead

# The library, its headers, the launcher, a CMake package and a pkg-config file (cmake/Install.cmake).
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD)
