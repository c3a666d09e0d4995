"""gen_emu.py CU_FILE > CPP_FILE: a runtime/cuda/*.cu file as plain C++ for the CPU emulation of
tests/cuda_emu/shim.h. The CUDA headers become shim.h; every kernel launch f<<<cfg>>>(args)
becomes emu_launch(emu_cfg(cfg), "f", sync, &f, args), sync = 1 for the kernels that
synchronize threads (they call __syncthreads, a warp shuffle, a ballot or __syncwarp, directly
or through a __device__ function of the same file): those run as fibers (shim.h). Used by the
Makefile (build/cuda_emu/)."""
import re
import sys

SYNC = re.compile(r'\b(__syncthreads|__shfl_\w+|__ballot_sync|__syncwarp)\s*\(')


def functions(src):
    """name -> body of every __global__ / __device__ function defined in src"""
    out = {}
    for m in re.finditer(r'\b(__global__|__device__)\b', src):
        i = m.end()
        paren = src.find('(', i)
        if paren < 0:
            continue
        head = src[i:paren]
        if ';' in head or '=' in head or '{' in head:  # a variable, not a function
            continue
        name = re.findall(r'(\w+)\s*$', head)
        if not name:
            continue
        depth, j = 0, paren
        while j < len(src):  # the parameter list
            depth += {'(': 1, ')': -1}.get(src[j], 0)
            j += 1
            if depth == 0:
                break
        k = j
        while k < len(src) and src[k] not in '{;':
            k += 1
        if k >= len(src) or src[k] == ';':  # a declaration
            continue
        depth, e = 0, k
        while e < len(src):
            depth += {'{': 1, '}': -1}.get(src[e], 0)
            e += 1
            if depth == 0:
                break
        out[name[0]] = out.get(name[0], '') + src[k:e]
    return out


def sync_set(funcs):
    sync = {n for n, b in funcs.items() if SYNC.search(b)}
    changed = True
    while changed:
        changed = False
        for n, b in funcs.items():
            if n not in sync and any(re.search(r'\b%s\s*[<(]' % s, b) for s in sync):
                sync.add(n)
                changed = True
    return sync


def shared(m):
    """__shared__ T a[n], b[m]; -> static T a[n], b[m]; emu_shared(a, sizeof a); ...: the first
    thread of a block to reach the declaration fills the arrays with NaN bytes (shim.h), so a
    read before the block wrote them shows"""
    names = [re.match(r'\s*(\w+)', d).group(1) for d in m.group(2).split(',')]
    return 'static %s %s;%s' % (m.group(1), m.group(2),
                               ''.join(' emu_shared(%s, sizeof %s);' % (n, n) for n in names))


def main():
    src = open(sys.argv[1]).read()
    src = re.sub(r'#include <(cuda|cublas|cusolver|cub/)[^>]*>\n', '', src)
    src = src.replace('#include "cuda/common.cuh"\n', '')
    sync = sync_set(functions(src))
    src = re.sub(r'__shared__\s+((?:\w+\s+)*?\w+)\s+(\w+\s*\[[^;]*);', shared, src)

    def launch(m):
        f, cfg = m.group(1), m.group(2)
        base = re.sub(r'<.*', '', f)
        rest = src[m.end():].lstrip()
        comma = '' if rest.startswith(')') else ', '
        return 'emu_launch(emu_cfg(%s), "%s", %d, &%s%s' % (cfg, f, int(base in sync), f, comma)

    launch_re = re.compile(r'(\w+(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(', re.S)
    out, pos = [], 0
    for m in launch_re.finditer(src):
        out.append(src[pos:m.start()])
        out.append(launch(m))
        pos = m.end()
    out.append(src[pos:])
    sys.stdout.write('#include "shim.h"\n' + ''.join(out))


main()
