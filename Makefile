# kvcc top-level Makefile.
#   make              build everything into build/ (kvcc, libkvrt.{a,so}, libkvpol.{a,so})
#   make test         install missing Debian packages, build, run the whole suite (CI runs this)
#   make test SAN=1   the same suite under ASan + UBSan (build tree build/san/)
#   make backend-ops  every op of the backend table on every backend (tests/backend/)
#   make test-openblas  the OpenBLAS-only build's backend ops, AM and BLAS tests (build/openblas)
#   make demo         the main job on the embedded default model
#   make fuzz         build the libFuzzer targets (clang) and run each for FUZZ_SECONDS
#   make bench        benchmarks (not tests)
#   make examples     the examples against the serving header only (build/examples/)
#   make install      kvcc, libkvrt/libkvpol (static + shared, versioned soname), headers,
#                     kvrt.pc/kvpol.pc, and kvcc's default texts and model (when fetched) in
#                     PREFIX/share/kvcc, into PREFIX (default /usr/local; DESTDIR honoured)
#   make uninstall    removes exactly what make install put there
#   make check-install  install into a scratch prefix and build an example with pkg-config only
# Switches: USE_CUDA=0/1 (default: 1 when nvcc is found), USE_MPI=0/1 (default: 1 when mpicc is
# found, 0 with SAN=1), USE_DNNL=0/1 (default: 1 when oneDNN's dnnl.h is found: the f32 GEMMs of
# the built-in model and the CPU policies through dnnl_sgemm, OpenBLAS otherwise), SAN=1, OPT=-O2.

CC       ?= cc
NVCC     ?= nvcc
# The builds inside make test / demo / bench / fuzz / test-openblas compile JOBS files at once
# (default: the machine's cores) unless the command line gave its own -j
JOBS     ?= $(shell nproc 2>/dev/null || echo 1)
SUBJ      = $(if $(filter -j%,$(MAKEFLAGS)),,-j$(JOBS))
CLANG    ?= clang
OPT      ?= -O2
SAN      ?= 0
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))

ifeq ($(SAN),1)
  BUILD := build/san
  SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
  # CUDA's runtime and ASan's shadow memory do not mix; the sanitizer build is CPU-only.
  USE_CUDA := 0
else ifeq ($(SAN),0)
  # BUILDDIR=build/xyz: a separate tree (parallel work on one checkout)
  BUILD := $(or $(BUILDDIR),build)
  SANFLAGS :=
else
  $(error SAN must be 0 or 1, got '$(SAN)')
endif

ifeq ($(origin USE_CUDA),undefined)
  ifneq ($(shell command -v $(NVCC) 2>/dev/null),)
    USE_CUDA := 1
  else
    USE_CUDA := 0
  endif
endif
# MPI (Open MPI): `mpirun -np N kvcc compile` (compiler/dist.c). The sanitizer build leaves it
# out unless asked (Open MPI's own allocations would fill LeakSanitizer's report).
MPICC ?= mpicc
ifeq ($(origin USE_MPI),undefined)
  ifeq ($(SAN),1)
    USE_MPI := 0
  else ifneq ($(shell command -v $(MPICC) 2>/dev/null),)
    USE_MPI := 1
  else
    USE_MPI := 0
  endif
endif
# oneDNN (Debian libdnnl-dev): the f32 matrix products of the built-in model and of the CPU policies
# (runtime/cpu/blas.c; libkvrt then links libdnnl). OpenBLAS 0.3.21
# picks generic kernels on CPUs it does not know; oneDNN dispatches on the ISA itself.
DNNL_H := $(wildcard /usr/include/dnnl.h /usr/local/include/dnnl.h)
ifeq ($(origin USE_DNNL),undefined)
  ifneq ($(DNNL_H),)
    USE_DNNL := 1
  else
    USE_DNNL := 0
  endif
endif
ifneq ($(filter-out 0 1,$(USE_DNNL)),)
  $(error USE_DNNL must be 0 or 1, got '$(USE_DNNL)')
endif
ifneq ($(filter-out 0 1,$(USE_MPI)),)
  $(error USE_MPI must be 0 or 1, got '$(USE_MPI)')
endif
ifneq ($(filter-out 0 1,$(USE_CUDA)),)
  $(error USE_CUDA must be 0 or 1, got '$(USE_CUDA)')
endif

ifeq ($(MAKELEVEL),0)
  ifeq ($(USE_CUDA),1)
    $(info kvcc: CUDA backend ON ($(NVCC) from $(CUDA_HOME)); USE_CUDA=0 to disable)
  else ifeq ($(SAN),1)
    $(info kvcc: CUDA backend OFF (SAN=1 builds are CPU-only); CPU backend only)
  else
    $(info kvcc: CUDA backend OFF ($(if $(shell command -v $(NVCC) 2>/dev/null),USE_CUDA=0,nvcc not found)); CPU backend only)
  endif
  ifeq ($(USE_MPI),1)
    $(info kvcc: MPI ON ($(MPICC): mpirun -np N kvcc compile); USE_MPI=0 to disable)
  else ifeq ($(SAN),1)
    $(info kvcc: MPI OFF (SAN=1 builds leave it out; USE_MPI=1 to force); one process only)
  else
    $(info kvcc: MPI OFF ($(if $(shell command -v $(MPICC) 2>/dev/null),USE_MPI=0,mpicc not found)); one process only)
  endif
  ifeq ($(USE_DNNL),1)
    $(info kvcc: oneDNN ON (f32 GEMMs of the model and the CPU policies through dnnl_sgemm); USE_DNNL=0 for OpenBLAS)
  else
    $(info kvcc: oneDNN OFF ($(if $(DNNL_H),USE_DNNL=0,dnnl.h not found: apt-get install libdnnl-dev)); f32 GEMMs through OpenBLAS)
  endif
endif

WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wno-unused-parameter
CPPFLAGS += -Iformats -Iruntime/include -Itests/golden -Iruntime -Icalib -Icompiler -I/usr/include/hdf5/serial -D_GNU_SOURCE
CFLAGS   += -std=c11 $(OPT) -g $(WARN) -fPIC -fopenmp $(SANFLAGS)
LDFLAGS  += -fopenmp $(SANFLAGS)
HDF5_LIBS := -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lhdf5
LIBS_FORMATS := -lzstd -lxxhash
LIBS_BLAS    := -lopenblas -llapacke
LIBS_JSON    := -lcjson
# -fmad=false: no multiply-add contracted into an FMA (nvcc's default contracts them; the C11
# CPU build never does), so a kernel doing a reference's arithmetic in its order rounds as the
# reference does: selections computed on the device then equal the CPU's (tests/backend).
NVCCFLAGS ?= -O2 -std=c++17 -fmad=false -Xcompiler -fPIC -Xcompiler -Wall \
             -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
# The CUDA backend is its own shared object, $(BUILD)/libkvrt_cuda.so (soname
# libkvrt_cuda.so.X.Y), the only file linked with libcudart/libcublas/libcusolver: libkvrt (shared or
# static) dlopens it when a CUDA context is created (runtime/core/cuda_load.c), so nothing that
# links libkvrt needs the CUDA libraries, and CPU-only runs never map them. LIBS_CUDA is what a
# program linking libkvrt adds for it (dlopen: libc's since glibc 2.34, -ldl for older ones).
ifeq ($(USE_CUDA),1)
  CPPFLAGS += -DKVRT_WITH_CUDA=1
  LIBS_CUDA_RT := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcusolver -lcublas -lcudart -lstdc++
  LIBS_CUDA := -ldl
  # programs linked in the tree (build/tests, build/bench, build/examples) find the backend in
  # $(BUILD) through their RUNPATH, which dlopen searches for the calling program
  RPATH_TREE := -Wl,-rpath,'$$ORIGIN/..'
else
  LIBS_CUDA_RT :=
  LIBS_CUDA :=
endif
ifeq ($(USE_DNNL),1)
  CPPFLAGS += -DKVCC_WITH_DNNL=1
  LIBS_DNNL := -ldnnl
else
  LIBS_DNNL :=
endif
ifeq ($(USE_MPI),1)
  CPPFLAGS += -DKVCC_WITH_MPI=1 $(shell $(MPICC) --showme:compile)
  LIBS_MPI := $(shell $(MPICC) --showme:link)
else
  LIBS_MPI :=
endif

# The library version comes from kvrt.h. Before 1.0 a minor release may change the ABI, so the
# soname carries major.minor: libkvrt.so.0.1 -> libkvrt.so.0.1.0 (docs/install.md).
KVRT_VERSION := $(shell sed -n 's/^\#define KVRT_VERSION_STRING "\(.*\)"/\1/p' runtime/include/kvrt.h)
KVRT_ABI     := $(word 1,$(subst ., ,$(KVRT_VERSION))).$(word 2,$(subst ., ,$(KVRT_VERSION)))

# ---------------------------------------------------------------- sources
FORMATS_SRC  := $(wildcard formats/*.c)
RUNTIME_SRC  := $(wildcard runtime/core/*.c runtime/cpu/*.c)
CUDA_SRC     := $(if $(filter 1,$(USE_CUDA)),$(wildcard runtime/cuda/*.cu))
CALIB_SRC    := $(wildcard calib/*.c)
COMPILER_SRC := $(wildcard compiler/*.c compiler/passes/*.c)
TEST_SRC     := $(wildcard tests/unit/*.c) tests/golden/cases.c tests/golden/inputs.c
BENCH_SRC    := $(wildcard bench/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
FORMATS_OBJ  := $(call obj,$(FORMATS_SRC))
RUNTIME_OBJ  := $(call obj,$(RUNTIME_SRC))
CUDA_OBJ     := $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(CUDA_SRC))
CALIB_OBJ    := $(call obj,$(CALIB_SRC))
COMPILER_OBJ := $(call obj,$(COMPILER_SRC))
TEST_OBJ     := $(call obj,$(TEST_SRC))

LIBKVPOL_A := $(BUILD)/libkvpol.a
LIBKVPOL_SO:= $(BUILD)/libkvpol.so
LIBKVRT_A  := $(BUILD)/libkvrt.a
LIBKVRT_SO := $(BUILD)/libkvrt.so
LIBKVRT_CUDA := $(if $(filter 1,$(USE_CUDA)),$(BUILD)/libkvrt_cuda.so)
LIBCALIB_A := $(BUILD)/libkvcalib.a
KVCC       := $(BUILD)/kvcc
TESTS      := $(BUILD)/tests/kvcc_tests
FUZZ_REPLAY:= $(BUILD)/tests/fuzz_replay
FUZZ_REPLAY_INPUTS := $(BUILD)/tests/fuzz_replay_corpus $(BUILD)/tests/fuzz_replay_gguf
BACKEND_OPS:= $(BUILD)/tests/test_backend_ops
BENCHES    := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))
EXAMPLES   := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))

ALL_LIBS := $(LIBCALIB_A) $(LIBKVRT_A) $(LIBKVPOL_A) $(HDF5_LIBS) $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) \
            $(LIBS_FORMATS) $(LIBS_JSON) $(LIBS_MPI) -lm -lpthread

.PHONY: all deps peer-deps model test test-cuda-emu python-test test-openblas check check-cli backend-ops cuda-emu-asan demo fuzz bench examples golden golden-inputs clean \
        install uninstall check-install
all: $(LIBKVPOL_A) $(LIBKVPOL_SO) $(LIBKVRT_A) $(LIBKVRT_SO) $(LIBKVRT_CUDA) $(KVCC)

deps:
	@bash scripts/install-deps.sh
peer-deps:
	@bash scripts/install-peer-deps.sh

# ---------------------------------------------------------------- rules
# compiler/dist.o is rebuilt when USE_MPI changes (the stamp names the setting).
MPI_STAMP := $(BUILD)/use_mpi.$(USE_MPI)
$(MPI_STAMP):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/use_mpi.* && touch $@
$(BUILD)/obj/compiler/dist.o: $(MPI_STAMP)
# calib/model.o and runtime/cpu/blas.o likewise for USE_DNNL.
DNNL_STAMP := $(BUILD)/use_dnnl.$(USE_DNNL)
$(DNNL_STAMP):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/use_dnnl.* && touch $@
$(BUILD)/obj/calib/model.o $(BUILD)/obj/runtime/cpu/blas.o: $(DNNL_STAMP)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -Xcompiler -fvisibility=hidden -MMD -MP -c $< -o $@

$(LIBKVPOL_A): $(FORMATS_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^
$(LIBKVPOL_SO): $(FORMATS_OBJ)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkvpol.so.$(KVRT_ABI) -o $@ $^ $(LIBS_FORMATS)
	ln -sf $(notdir $@) $@.$(KVRT_ABI)  # the soname, for programs linked in the tree
$(LIBKVRT_A): $(RUNTIME_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^
# libkvrt.so comes with its CUDA backend beside it (order-only: either can be rebuilt alone).
$(LIBKVRT_SO): $(RUNTIME_OBJ) $(FORMATS_OBJ) | $(LIBKVRT_CUDA)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkvrt.so.$(KVRT_ABI) -o $@ $(RUNTIME_OBJ) $(FORMATS_OBJ) \
	  $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) $(LIBS_FORMATS) -lm
	ln -sf $(notdir $@) $@.$(KVRT_ABI)  # the soname, for programs linked in the tree
# The CUDA backend: every symbol hidden but kvrt_cuda_plugin_init (runtime/cuda/cuda_backend.cu);
# it calls back into libkvrt only through the pointers it is handed, so it links no libkvrt.
$(BUILD)/libkvrt_cuda.so: $(CUDA_OBJ)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkvrt_cuda.so.$(KVRT_ABI) -Wl,--no-undefined -o $@ $^ \
	  $(LIBS_CUDA_RT) -lm
	ln -sf $(notdir $@) $@.$(KVRT_ABI)  # the soname, which libkvrt looks for first
$(LIBCALIB_A): $(CALIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^ $(if $(CALIB_OBJ),,$(error no calib sources))

# The compiler's commands and passes (everything but main.c) also link into the tests.
LIBCLI_A := $(BUILD)/libkvcccli.a
$(LIBCLI_A): $(filter-out $(BUILD)/obj/compiler/main.o,$(COMPILER_OBJ))
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^

$(KVCC): $(BUILD)/obj/compiler/main.o $(LIBCLI_A) $(LIBCALIB_A) $(LIBKVRT_A) $(LIBKVPOL_A) | $(LIBKVRT_CUDA)
	$(CC) $(LDFLAGS) -o $@ $(BUILD)/obj/compiler/main.o $(LIBCLI_A) $(ALL_LIBS)

$(TESTS): $(TEST_OBJ) $(LIBCLI_A) $(LIBCALIB_A) $(LIBKVRT_A) $(LIBKVPOL_A) | $(LIBKVRT_CUDA)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(RPATH_TREE) -o $@ $(TEST_OBJ) $(LIBCLI_A) $(ALL_LIBS) -lcriterion

# Every op of the backend table on every backend against its reference (tests/backend/).
$(BACKEND_OPS): $(BUILD)/obj/tests/backend/test_backend_ops.o $(LIBKVRT_A) $(LIBKVPOL_A) | $(LIBKVRT_CUDA)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(RPATH_TREE) -o $@ $< $(LIBKVRT_A) $(LIBKVPOL_A) $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) \
	  $(LIBS_FORMATS) -lm -lpthread

# The CUDA backend run on the CPU (tests/cuda_emu, docs/cuda.md "Emulation"): every
# runtime/cuda/*.cu turned into C++ (gen_emu.py) over an emulation of the CUDA runtime, cuBLAS
# and CUB (shim.h, emu_rt.cpp), so that its logic is checked on every machine, a GPU or not (no
# nvcc needed): libkvrt_cuda_emu.so is a CUDA plugin that libkvrt loads through
# KVRT_CUDA_LIBRARY (tests/backend runs its CUDA rows on it), cuda_emu_am runs am.cu's own cases.
# Plain builds only: the sanitizer build's libkvrt.a needs ASan in the program.
CUDA_EMU_SRC  := $(wildcard runtime/cuda/*.cu)
CUDA_EMU_OBJ  := $(patsubst runtime/cuda/%.cu,$(BUILD)/cuda_emu/%_emu.o,$(CUDA_EMU_SRC))
CUDA_EMU_LIB  := $(BUILD)/cuda_emu/libkvrt_cuda_emu.so
CUDA_EMU_AM   := $(BUILD)/tests/cuda_emu_am
CUDA_EMU      := $(if $(SANFLAGS),,$(CUDA_EMU_AM) $(CUDA_EMU_LIB))
.SECONDARY: $(patsubst runtime/cuda/%.cu,$(BUILD)/cuda_emu/%_emu.cpp,$(CUDA_EMU_SRC)) # kept to read
EMU_CXX := $(CXX) -std=c++17 -O2 -g -ffp-contract=off -U_FORTIFY_SOURCE -fPIC -fvisibility=hidden -Itests/cuda_emu \
  -Iruntime -Iruntime/include -Iformats -D_GNU_SOURCE
EMU_DEPS := tests/cuda_emu/shim.h runtime/cuda/common.cuh runtime/core/backend.h \
  runtime/include/kvrt.h runtime/include/kvrt_experimental.h
$(BUILD)/cuda_emu/%_emu.cpp: runtime/cuda/%.cu tests/cuda_emu/gen_emu.py
	@mkdir -p $(dir $@)
	python3 tests/cuda_emu/gen_emu.py $< > $@
# MR_WS_BYTES: merge-reduce's batch workspace tiny, so that its chunked path runs here
$(BUILD)/cuda_emu/%_emu.o: $(BUILD)/cuda_emu/%_emu.cpp $(EMU_DEPS) runtime/core/am_plan.h runtime/core/policies.h
	$(EMU_CXX) -DMR_WS_BYTES=65536 -c -o $@ $<
$(BUILD)/cuda_emu/%.o: tests/cuda_emu/%.cpp $(EMU_DEPS)
	@mkdir -p $(dir $@)
	$(EMU_CXX) -c -o $@ $<
$(CUDA_EMU_LIB): $(CUDA_EMU_OBJ) $(BUILD)/cuda_emu/emu_rt.o
	$(CXX) -shared -o $@ $^ -lm -lpthread
$(CUDA_EMU_AM): $(BUILD)/cuda_emu/am_emu.o $(BUILD)/cuda_emu/select_emu.o $(BUILD)/cuda_emu/emu_rt.o \
                $(BUILD)/cuda_emu/emu_err.o tests/cuda_emu/am_emu_test.cpp $(EMU_DEPS) $(LIBKVRT_A) $(LIBKVPOL_A)
	@mkdir -p $(dir $@)
	$(EMU_CXX) -fopenmp -o $@ $(filter %.o %.cpp,$^) $(LIBKVRT_A) $(LIBKVPOL_A) $(LIBS_DNNL) \
	  $(LIBS_BLAS) $(LIBS_CUDA) $(LIBS_FORMATS) -lm -lpthread

# The fuzz target's own source doubles as the replay driver's body.
$(FUZZ_REPLAY): tests/fuzz/fuzz_kvpol.c tests/fuzz/replay.c $(LIBKVPOL_A)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ tests/fuzz/replay.c tests/fuzz/fuzz_kvpol.c $(LIBKVPOL_A) $(LIBS_FORMATS) $(LDFLAGS)

# The corpus and GGUF targets replayed the same way (their seeds: the golden invalid inputs).
$(BUILD)/tests/fuzz_replay_%: tests/fuzz/fuzz_%.c tests/fuzz/replay.c tests/golden/inputs.c \
    $(LIBCALIB_A) $(LIBKVRT_A) $(LIBKVPOL_A)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ tests/fuzz/replay.c $< tests/golden/inputs.c $(ALL_LIBS) $(LDFLAGS)

$(BUILD)/bench/%: bench/%.c $(LIBCALIB_A) $(LIBKVRT_A) $(LIBKVPOL_A) | $(LIBKVRT_CUDA)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ $< $(ALL_LIBS) $(LDFLAGS) $(RPATH_TREE)

# Examples see runtime/include only, as a serving stack does.
examples: $(EXAMPLES)
$(BUILD)/examples/%: examples/%.c $(LIBKVRT_A) $(LIBKVPOL_A) | $(LIBKVRT_CUDA)
	@mkdir -p $(dir $@)
	$(CC) -Iruntime/include $(CFLAGS) -o $@ $< $(LIBKVRT_A) $(LIBKVPOL_A) $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) \
	  $(LIBS_FORMATS) -lm $(LDFLAGS) $(RPATH_TREE)

# ---------------------------------------------------------------- suites
# The real-model tests need the default model; without network they skip visibly.
model:
	@bash scripts/fetch-model.sh || echo "kvcc: WARNING: model not fetched; the tests that need it will say 'skipped'"

test: deps peer-deps model
	@$(MAKE) --no-print-directory $(SUBJ) all $(TESTS) $(FUZZ_REPLAY) $(FUZZ_REPLAY_INPUTS) $(BACKEND_OPS) \
	  $(EXAMPLES) $(CUDA_EMU) $(CUDA_EMU_ASAN)
	@echo "== backend ops (tests/backend: every op on every backend against its reference)"
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BACKEND_OPS)
	@if [ -n "$(CUDA_EMU)" ]; then $(MAKE) --no-print-directory $(SUBJ) test-cuda-emu; fi
	@echo "== unit, golden and equivalence tests (Criterion)"
	@KVCC_BUILD=$(BUILD) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp \
	  $(TESTS) --jobs 2
	@if [ "$(USE_DNNL)" = 1 ] && [ "$(SAN)" = 0 ]; then \
	  echo "== the bf16 tests where oneDNN has no bf16 kernel (ONEDNN_MAX_CPU_ISA=AVX2: the widened f32 fallback AVX2-only CPUs run)"; \
	  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	    KVCC_BUILD=$(BUILD) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} ONEDNN_MAX_CPU_ISA=AVX2 \
	      $(TESTS) --jobs 2 --filter '*/*bf16*' || exit 1; \
	  else echo "bf16 fallback: run by the Criterion suite above (this CPU has no AVX-512: no bf16 kernel to turn off)"; fi; fi
	@echo "== fuzz corpus replay"
	@$(FUZZ_REPLAY) tests/fuzz/corpus tests/golden/valid tests/golden/invalid
	@$(BUILD)/tests/fuzz_replay_corpus tests/golden/invalid-corpus $(wildcard tests/fuzz/corpus-h5)
	@$(BUILD)/tests/fuzz_replay_gguf tests/golden/invalid-gguf $(wildcard tests/fuzz/corpus-gguf)
	@echo "== CLI checks"
	@KVCC=$(KVCC) KVCC_BUILD=$(BUILD) bash tests/cli/run.sh
	@echo "== CLI fault checks (full disk, read-only directory, output = input, signals, stdout errors)"
	@KVCC=$(KVCC) KVCC_BUILD=$(BUILD) bash tests/cli/faults.sh
	@echo "== make install into a scratch prefix, serve_skeleton.c built out of tree with pkg-config only"
	@KVCC_BUILD=$(BUILD) MAKE="$(MAKE)" SANFLAGS="$(SANFLAGS)" bash tests/cli/install.sh
	@echo "== MPI checks (mpirun -np 2 and 4 kvcc compile against one process; docs/distributed.md)"
	@KVCC=$(KVCC) bash tests/cli/mpi.sh
	@echo "== corpora of several files, mpirun capture (tests/cli/mpi_capture.sh)"; KVCC=$(KVCC) bash tests/cli/mpi_capture.sh
	@if [ -f tests/peer/run.sh ]; then KVCC_BUILD=$(BUILD) bash tests/peer/run.sh; fi
	@$(MAKE) --no-print-directory python-test
	@if [ "$(USE_DNNL)" = 1 ] && [ "$(SAN)" = 0 ]; then $(MAKE) --no-print-directory test-openblas; fi

# What a machine without libdnnl-dev builds (USE_DNNL=0: every CPU product on OpenBLAS), in
# build/openblas: the backend ops and the AM and BLAS unit tests, among them the same bits at
# any OpenMP and OpenBLAS thread count (am/one_head_same_bits_at_any_blas_thread_count). About
# a minute on 2 cores; `make test` runs it after the main suite when that suite used oneDNN.
test-openblas:
	@echo "== the OpenBLAS-only build (USE_DNNL=0, build/openblas): backend ops, AM and BLAS tests"
	@$(MAKE) --no-print-directory $(SUBJ) USE_DNNL=0 USE_CUDA=0 USE_MPI=0 BUILDDIR=build/openblas \
	  build/openblas/tests/kvcc_tests build/openblas/tests/test_backend_ops >/dev/null
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} build/openblas/tests/test_backend_ops
	@for f in 'am/*' 'blas/*'; do \
	  KVCC_BUILD=build/openblas OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
	    build/openblas/tests/kvcc_tests --jobs 2 --filter "$$f" || exit 1; done

# The Python package (python/kvrt) against this build tree's libkvrt.so: pytest python/tests.
PYTHON ?= python3
python-test:
ifeq ($(SAN),1)
	@echo "python tests: run by the plain build (libasan cannot be loaded into python)"
else
	@$(MAKE) --no-print-directory all
	@echo "== Python package (python/tests: the bindings against the C calls, pytest)"
	@if $(PYTHON) -c 'import pytest, numpy' 2>/dev/null; then \
	  KVCC_BUILD=$(BUILD) KVRT_LIBRARY=$(CURDIR)/$(LIBKVRT_SO) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
	    $(PYTHON) -m pytest -q -p no:cacheprovider python/tests; \
	else echo "python tests: skipped (pytest or numpy not installed: make peer-deps)"; fi
endif

# The CLI checks alone: tests/cli/run.sh, then tests/cli/faults.sh (each prints its summary line).
# make test's CUDA steps (plain builds): tests/backend's CUDA rows on the AddressSanitizer build of
# the emulated plugin, on one core beside the cuda/* units and cuda_emu_am (it runs single-threaded:
# 47 s alone on the 2-core EPYC; the three steps took 55 + 28 + 17 s one after another), its output
# printed after theirs. ASan's one warning about makecontext / swapcontext is expected: they only
# start the emulator's fibers, whose switches then go through ASan's fiber annotations.
test-cuda-emu: $(TESTS) $(BACKEND_OPS) $(CUDA_EMU) $(CUDA_EMU_ASAN)
	@echo "== the CUDA backend on the CPU (tests/cuda_emu: every runtime/cuda/*.cu emulated)"; \
	st=0; rows_pid=; rows_log=$(BUILD)/cuda_emu/asan/rows.log; \
	if [ "$(USE_CUDA)" = 1 ]; then \
	  echo "tests/backend's CUDA rows on the plugin's AddressSanitizer build: started beside the two steps below (on one core), printed after them"; \
	  ( ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD=$$($(CXX) -print-file-name=libasan.so) \
	    KVRT_CUDA_LIBRARY=$(CURDIR)/$(CUDA_EMU_ASAN) OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 \
	    $(BACKEND_OPS) > $$rows_log 2>&1 ) & rows_pid=$$!; \
	  echo "== the CUDA unit tests on the emulated plugin (kvcc_tests cuda/*; softmax_matches_ref, 2 min emulated, is left to tests/backend's rows and the GPU)"; \
	  KVRT_CUDA_LIBRARY=$(CURDIR)/$(CUDA_EMU_LIB) KVCC_BUILD=$(BUILD) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
	    $(TESTS) --jobs 2 --filter 'cuda/[!s]*' || st=1; \
	  KVRT_CUDA_LIBRARY=$(CURDIR)/$(CUDA_EMU_LIB) KVCC_BUILD=$(BUILD) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
	    $(TESTS) --filter 'cuda/softmax_edge*' || st=1; \
	else echo "backend-ops (cuda emulated): skipped: libkvrt built without its CUDA loader (USE_CUDA=0)"; fi; \
	echo "== the CUDA AM compaction on the CPU (tests/cuda_emu: runtime/cuda/am.cu emulated, against the CPU path)"; \
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(CUDA_EMU_AM) || st=1; \
	if [ -n "$$rows_pid" ]; then \
	  wait $$rows_pid || st=1; \
	  echo "== tests/backend's CUDA rows on the emulated plugin built with AddressSanitizer (a kernel that reads or writes past a buffer stops with ASan's report)"; \
	  cat $$rows_log; fi; \
	exit $$st

check-cli: all $(EXAMPLES)
	@st=0; KVCC=$(KVCC) KVCC_BUILD=$(BUILD) bash tests/cli/run.sh || st=1; \
	  KVCC=$(KVCC) KVCC_BUILD=$(BUILD) bash tests/cli/faults.sh || st=1; exit $$st

backend-ops: $(BACKEND_OPS)
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BACKEND_OPS)

# tests/backend's CUDA rows on the emulated plugin built with AddressSanitizer: a kernel that
# reads or writes past a device buffer (host memory in the emulation) stops with ASan's report.
# `make test`'s plain pass runs the rows on this plugin (the same rows and bounds as on the plain
# one, plus the memory checks: 47-51 s on a 2-core EPYC against 24 s, and an 18 s build), beside
# other steps (test-cuda-emu); `make cuda-emu-asan` runs them alone. The plain plugin stays for
# the cuda/* units, cuda_emu_am and pytest.
CUDA_EMU_ASAN := $(if $(SANFLAGS),,$(if $(filter 1,$(USE_CUDA)),$(BUILD)/cuda_emu/asan/libkvrt_cuda_emu.so))
CUDA_EMU_ASAN_OBJ := $(patsubst runtime/cuda/%.cu,$(BUILD)/cuda_emu/asan/%_emu.o,$(CUDA_EMU_SRC)) \
                     $(BUILD)/cuda_emu/asan/emu_rt.o
$(BUILD)/cuda_emu/asan/%_emu.o: $(BUILD)/cuda_emu/%_emu.cpp $(EMU_DEPS) runtime/core/am_plan.h runtime/core/policies.h
	@mkdir -p $(dir $@)
	$(EMU_CXX) -DMR_WS_BYTES=65536 -O1 -fsanitize=address -fno-omit-frame-pointer -c -o $@ $<
$(BUILD)/cuda_emu/asan/emu_rt.o: tests/cuda_emu/emu_rt.cpp $(EMU_DEPS)
	@mkdir -p $(dir $@)
	$(EMU_CXX) -O1 -fsanitize=address -fno-omit-frame-pointer -c -o $@ $<
$(BUILD)/cuda_emu/asan/libkvrt_cuda_emu.so: $(CUDA_EMU_ASAN_OBJ)
	$(CXX) -shared -fsanitize=address -o $@ $^ -lm -lpthread
cuda-emu-asan: $(BUILD)/cuda_emu/asan/libkvrt_cuda_emu.so $(BACKEND_OPS)
	@echo "== tests/backend's CUDA rows on the emulated plugin under AddressSanitizer"
	@ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD=$$($(CXX) -print-file-name=libasan.so) \
	  KVRT_CUDA_LIBRARY=$(CURDIR)/$(BUILD)/cuda_emu/asan/libkvrt_cuda_emu.so \
	  OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BACKEND_OPS)

check: all $(TESTS)
	@KVCC_BUILD=$(BUILD) OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(TESTS) --jobs 2

demo: deps
	@bash scripts/fetch-model.sh
	@$(MAKE) --no-print-directory $(SUBJ) all
	@KVCC=$(KVCC) bash scripts/demo.sh

# make fuzz [FUZZ_TARGETS="kvpol kvpol_struct corpus gguf"] [FUZZ_SECONDS=60]: each target in
# turn, its new inputs kept under build/fuzz/<target>/ (seeds: the saved and golden files).
# The corpus and GGUF readers are built instrumented from source; libkvrt links plain (gcc).
# fuzz_corpus stops within seconds on memory errors inside Debian's libhdf5 1.10 itself (H5Aexists,
# H5Fopen: docs/corpus-format.md says corpora from untrusted sources need a sandbox); its
# findings in kvcc's own code are what it is for.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= kvpol kvpol_struct corpus gguf
FUZZ_CFLAGS := $(CPPFLAGS) -std=c11 -O1 -g -fsanitize=fuzzer,address,undefined
FUZZ_SEEDS_kvpol        := tests/fuzz/corpus tests/golden/valid tests/golden/invalid
FUZZ_SEEDS_kvpol_struct := tests/golden/valid tests/fuzz/corpus
FUZZ_SEEDS_corpus       := tests/golden/invalid-corpus $(wildcard tests/fuzz/corpus-h5)
FUZZ_SEEDS_gguf         := tests/golden/invalid-gguf $(wildcard tests/fuzz/corpus-gguf)
FUZZ_READERS := calib/corpus.c calib/gguf.c calib/model.c calib/calib_msg.c tests/golden/inputs.c
fuzz: deps
	@$(MAKE) --no-print-directory $(SUBJ) $(LIBKVRT_A)
	@mkdir -p build/fuzz
	$(CLANG) $(FUZZ_CFLAGS) -o build/fuzz/fuzz_kvpol tests/fuzz/fuzz_kvpol.c $(FORMATS_SRC) \
	  $(LIBS_FORMATS)
	@# the mutator itself uninstrumented: edges count the reader only, as fuzz_kvpol's do
	$(CLANG) $(CPPFLAGS) -std=c11 -O1 -g -fsanitize=address,undefined -c \
	  -o build/fuzz/fuzz_kvpol_struct.o tests/fuzz/fuzz_kvpol_struct.c
	$(CLANG) $(FUZZ_CFLAGS) -o build/fuzz/fuzz_kvpol_struct tests/fuzz/fuzz_kvpol.c \
	  build/fuzz/fuzz_kvpol_struct.o $(FORMATS_SRC) $(LIBS_FORMATS)
	for t in corpus gguf; do \
	  $(CLANG) $(FUZZ_CFLAGS) -fopenmp=libgomp -o build/fuzz/fuzz_$$t tests/fuzz/fuzz_$$t.c \
	    $(FUZZ_READERS) $(FORMATS_SRC) $(LIBKVRT_A) $(HDF5_LIBS) $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) \
	    $(LIBS_FORMATS) -lgomp -lm -lpthread || exit 1; \
	done
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/$$t; \
	  echo "== fuzz_$$t for $(FUZZ_SECONDS) s"; \
	  seeds="$(FUZZ_SEEDS_kvpol)"; \
	  case $$t in kvpol_struct) seeds="$(FUZZ_SEEDS_kvpol_struct)";; \
	    corpus) seeds="$(FUZZ_SEEDS_corpus)";; gguf) seeds="$(FUZZ_SEEDS_gguf)";; esac; \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/fuzz/lsan_hdf5.supp ASAN_OPTIONS=allocator_may_return_null=1 \
	  build/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=4096 \
	    -artifact_prefix=build/fuzz/$$t- build/fuzz/$$t $$seeds || exit 1; \
	done

bench: deps
	@$(MAKE) --no-print-directory $(SUBJ) all $(BENCHES)
	@for b in $(BENCHES); do echo "== $$b"; $$b || exit 1; done

# Regenerate the committed golden files (tests check that they still match the cases).
golden: $(BUILD)/tests/gen_golden
	$(BUILD)/tests/gen_golden tests/golden
# The golden invalid corpora and GGUFs (h5py, numpy): tests/golden/invalid-{corpus,gguf}/.
golden-inputs:
	python3 tests/golden/gen_invalid_inputs.py tests/golden
$(BUILD)/tests/gen_golden: tests/golden/gen.c tests/golden/cases.c $(LIBKVPOL_A)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -Itests/golden -o $@ tests/golden/gen.c tests/golden/cases.c $(LIBKVPOL_A) $(LIBS_FORMATS) $(LDFLAGS)

# ---------------------------------------------------------------- install
# make install [PREFIX=/usr/local] [DESTDIR=] [LIBDIR=$(PREFIX)/lib]: the serving headers
# (kvrt.h, kvrt_experimental.h, kvrt_rng.h; kvpol.h, kvpol_sections.h), both libraries static and
# shared (real name .so.X.Y.Z, soname .so.X.Y, link name .so), kvcc, and kvrt.pc / kvpol.pc
# written for PREFIX. A consumer needs nothing but `pkg-config --cflags --libs kvrt`.
PREFIX     ?= /usr/local
BINDIR     ?= $(PREFIX)/bin
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
# BINDIR/../share/kvcc: where the installed kvcc looks for its data (compiler/util.c)
DATADIR     = $(dir $(patsubst %/,%,$(BINDIR)))share/kvcc
# kvcc capture's default model (compiler/cmd_capture.c DEFAULT_GGUF; scripts/fetch-model.sh)
DEFAULT_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
INSTALL_HEADERS := runtime/include/kvrt.h runtime/include/kvrt_experimental.h \
                   runtime/include/kvrt_rng.h formats/kvpol.h formats/kvpol_sections.h
# What a static link of libkvrt.a needs after it (pkg-config --static); the shared library
# carries its own dependencies.
KVRT_PRIVATE := -lkvpol $(LIBS_DNNL) $(LIBS_BLAS) $(LIBS_CUDA) $(LIBS_FORMATS) -lm -lpthread -fopenmp
# The .pc files are written straight into PKGCONFIGDIR by each install (nothing in the build
# tree, which a root install would leave root-owned), relative to ${prefix} where LIBDIR and
# INCLUDEDIR lie under PREFIX, so that `pkg-config --define-prefix` relocates them.
pc_dir = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))
pc_file = printf '%s\n' 'prefix=$(PREFIX)' 'exec_prefix=$${prefix}' 'libdir=$(call pc_dir,$(LIBDIR))' \
  'includedir=$(call pc_dir,$(INCLUDEDIR))' '' 'Name: $(1)' 'Description: $(2)' 'Version: $(KVRT_VERSION)' \
  'Libs: -L$${libdir} -l$(1)' 'Libs.private: $(strip $(3))' 'Cflags: -I$${includedir}'
FORCE:

# libkvrt looks for its CUDA backend beside itself (the library, or the program it is linked
# into) and in BINDIR/$(CUDA_PLUGIN_RELDIR): LIBDIR relative to BINDIR, ../lib by default, so an
# installed kvcc (libkvrt linked in) finds the backend wherever LIBDIR put it
# (runtime/core/cuda_load.c). The stamp holds USE_CUDA and that path, rewritten only when
# either changes, which rebuilds the two objects that read them (a USE_CUDA=0 build also drops
# the old backend from the build tree, where pip's bundling would pick it up).
CUDA_PLUGIN_RELDIR := $(shell realpath -m --relative-to='$(BINDIR)' '$(LIBDIR)' 2>/dev/null || echo ../lib)
CUDA_STAMP := $(BUILD)/use_cuda.stamp
CUDA_STAMP_TEXT := $(USE_CUDA)$(if $(filter 1,$(USE_CUDA)), $(CUDA_PLUGIN_RELDIR))
$(CUDA_STAMP): FORCE
	@mkdir -p $(BUILD) && s='$(CUDA_STAMP_TEXT)' && \
	  if [ "$$(cat $@ 2>/dev/null)" != "$$s" ]; then echo "$$s" > $@; \
	    if [ $(USE_CUDA) = 0 ]; then rm -f $(BUILD)/libkvrt_cuda.so*; fi; fi
# make install never rebuilds for other settings than the build's (as root it would leave
# root-owned objects; under sudo, whose PATH may lack nvcc, it would drop CUDA): it refuses
ifneq ($(filter install,$(MAKECMDGOALS)),)
  CUDA_STAMP_BUILT := $(shell cat $(CUDA_STAMP) 2>/dev/null)
  ifneq ($(CUDA_STAMP_BUILT),)
    ifneq ($(CUDA_STAMP_BUILT),$(CUDA_STAMP_TEXT))
      $(error kvcc: make install: $(BUILD) was built with USE_CUDA and the CUDA backend's place relative to BINDIR '$(CUDA_STAMP_BUILT)', this install asks '$(CUDA_STAMP_TEXT)' (USE_CUDA=$(USE_CUDA), LIBDIR relative to BINDIR $(CUDA_PLUGIN_RELDIR)): run make with the same USE_CUDA, BINDIR and LIBDIR first (as the user), then make install)
    endif
  endif
endif
$(BUILD)/obj/runtime/core/ctx.o $(BUILD)/obj/runtime/core/cuda_load.o: $(CUDA_STAMP)
$(BUILD)/obj/runtime/core/cuda_load.o: CPPFLAGS += -DKVRT_CUDA_PLUGIN_RELDIR='"$(CUDA_PLUGIN_RELDIR)"'

# make's word lists (DATADIR, the uninstall lists) split paths at spaces: refused up front
install_paths_check = @for p in '$(DESTDIR)' '$(PREFIX)' '$(BINDIR)' '$(LIBDIR)' '$(INCLUDEDIR)' '$(PKGCONFIGDIR)'; do \
	  case "$$p" in *[[:space:]]*) echo "kvcc: make $@: the path '$$p' has a space; DESTDIR, PREFIX, BINDIR, LIBDIR, INCLUDEDIR and PKGCONFIGDIR must not" >&2; exit 2;; esac; done; \
	for p in '$(PREFIX)' '$(BINDIR)' '$(LIBDIR)' '$(INCLUDEDIR)' '$(PKGCONFIGDIR)'; do \
	  case "$$p" in /*) ;; *) echo "kvcc: make $@: the path '$$p' is relative; PREFIX, BINDIR, LIBDIR, INCLUDEDIR and PKGCONFIGDIR must be absolute (they are written into kvrt.pc and looked up at run time)" >&2; exit 2;; esac; done

install: all
	$(install_paths_check)
	@echo "kvcc: installing $(KVRT_VERSION) into $(DESTDIR)$(PREFIX)"
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR)
	install -m 755 $(KVCC) $(DESTDIR)$(BINDIR)/kvcc
	install -m 644 $(INSTALL_HEADERS) $(DESTDIR)$(INCLUDEDIR)/
	for l in kvrt kvpol; do \
	  install -m 644 $(BUILD)/lib$$l.a $(DESTDIR)$(LIBDIR)/lib$$l.a && \
	  install -m 755 $(BUILD)/lib$$l.so $(DESTDIR)$(LIBDIR)/lib$$l.so.$(KVRT_VERSION) && \
	  ln -sf lib$$l.so.$(KVRT_VERSION) $(DESTDIR)$(LIBDIR)/lib$$l.so.$(KVRT_ABI) && \
	  ln -sf lib$$l.so.$(KVRT_ABI) $(DESTDIR)$(LIBDIR)/lib$$l.so || exit 1; \
	done
	@echo "kvcc: writing kvrt.pc and kvpol.pc into $(DESTDIR)$(PKGCONFIGDIR)"
	@$(call pc_file,kvrt,kvcc runtime: load .kvpol KV-cache compression policies and run them,$(KVRT_PRIVATE)) > $(DESTDIR)$(PKGCONFIGDIR)/kvrt.pc
	@$(call pc_file,kvpol,kvcc .kvpol artifact format: validated reader and atomic writer,$(LIBS_FORMATS)) > $(DESTDIR)$(PKGCONFIGDIR)/kvpol.pc
	@chmod 644 $(DESTDIR)$(PKGCONFIGDIR)/kvrt.pc $(DESTDIR)$(PKGCONFIGDIR)/kvpol.pc
	@# the bundled texts (kvcc capture's and eval --needle's defaults) and, when fetched, the
	@# default model, where an installed kvcc looks for them (compiler/util.c kvcc_data_path)
	install -d $(DESTDIR)$(DATADIR)/examples/data/calib $(DESTDIR)$(DATADIR)/examples/data/heldout
	install -m 644 examples/data/calib/*.txt $(DESTDIR)$(DATADIR)/examples/data/calib/
	install -m 644 examples/data/heldout/*.txt $(DESTDIR)$(DATADIR)/examples/data/heldout/
	@if [ -f $(DEFAULT_MODEL) ]; then \
	  echo "install -m 644 $(DEFAULT_MODEL) $(DESTDIR)$(DATADIR)/models/"; \
	  install -d $(DESTDIR)$(DATADIR)/models && install -m 644 $(DEFAULT_MODEL) $(DESTDIR)$(DATADIR)/models/; \
	else echo "kvcc: $(DEFAULT_MODEL) not fetched (scripts/fetch-model.sh): the installed kvcc capture needs --gguf"; fi
ifeq ($(USE_CUDA),1)
	@# the CUDA backend beside libkvrt, where libkvrt looks for it (runtime/core/cuda_load.c)
	install -m 755 $(LIBKVRT_CUDA) $(DESTDIR)$(LIBDIR)/libkvrt_cuda.so.$(KVRT_VERSION)
	ln -sf libkvrt_cuda.so.$(KVRT_VERSION) $(DESTDIR)$(LIBDIR)/libkvrt_cuda.so.$(KVRT_ABI)
endif

uninstall:
	$(install_paths_check)
	rm -f $(DESTDIR)$(BINDIR)/kvcc $(addprefix $(DESTDIR)$(INCLUDEDIR)/,$(notdir $(INSTALL_HEADERS)))
	for l in kvrt kvpol; do \
	  rm -f $(DESTDIR)$(LIBDIR)/lib$$l.a $(DESTDIR)$(LIBDIR)/lib$$l.so \
	    $(DESTDIR)$(LIBDIR)/lib$$l.so.$(KVRT_ABI) $(DESTDIR)$(LIBDIR)/lib$$l.so.$(KVRT_VERSION) \
	    $(DESTDIR)$(PKGCONFIGDIR)/$$l.pc; \
	done
	rm -f $(DESTDIR)$(LIBDIR)/libkvrt_cuda.so.$(KVRT_ABI) $(DESTDIR)$(LIBDIR)/libkvrt_cuda.so.$(KVRT_VERSION)
	rm -f $(addprefix $(DESTDIR)$(DATADIR)/examples/data/calib/,$(notdir $(wildcard examples/data/calib/*.txt))) \
	  $(addprefix $(DESTDIR)$(DATADIR)/examples/data/heldout/,$(notdir $(wildcard examples/data/heldout/*.txt))) \
	  $(DESTDIR)$(DATADIR)/$(DEFAULT_MODEL)
	-rmdir $(DESTDIR)$(DATADIR)/examples/data/calib $(DESTDIR)$(DATADIR)/examples/data/heldout \
	  $(DESTDIR)$(DATADIR)/examples/data $(DESTDIR)$(DATADIR)/examples $(DESTDIR)$(DATADIR)/models \
	  $(DESTDIR)$(DATADIR) 2>/dev/null

# make install into a scratch prefix, then build examples/serve_skeleton.c out of tree with
# pkg-config only (shared and static), run it, and make uninstall (tests/cli/install.sh).
check-install: all
	@KVCC_BUILD=$(BUILD) MAKE="$(MAKE)" SANFLAGS="$(SANFLAGS)" bash tests/cli/install.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
