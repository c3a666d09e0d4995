"""gen_emu.py CU_FILE > CPP_FILE: a runtime/cuda/*.cu file as plain C++ for the CPU emulation of
tests/cuda_emu/shim.h: the CUDA headers become shim.h, every kernel launch f<<<cfg>>>(args)
becomes EMU_LAUNCH(emu_cfg(cfg), f, args). Used by the Makefile (build/cuda_emu/)."""
import re
import sys

src = open(sys.argv[1]).read()
src = src.replace('#include <cublas_v2.h>\n', '').replace('#include <cuda_runtime.h>\n', '')
src = src.replace('#include "cuda/common.cuh"\n', '#include "shim.h"\n')
src = re.sub(r'(\w+)<<<(.*?)>>>\(',
             lambda m: 'EMU_LAUNCH(emu_cfg(%s), %s, ' % (m.group(2), m.group(1)), src)
sys.stdout.write('#include "shim.h"\n' + src)
