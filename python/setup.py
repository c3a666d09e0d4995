"""Build hook of the kvrt package: `pip install ./python` from a kvcc checkout builds
build/libkvrt.so with the checkout's Makefile when it is missing or older than its sources
(`make -C <checkout> build/libkvrt.so`), and bundles the library into the package as
kvrt/_native/libkvrt.so, which the loader prefers over the in-tree and system copies (a CUDA
build's backend, libkvrt_cuda.so, goes beside it: libkvrt loads it from there on first use).

Environment: KVRT_USE_CUDA=0/1 passes USE_CUDA to make (default: the Makefile's choice, on when
nvcc is found); KVRT_BUILD_LIBRARY=/path/libkvrt.so bundles that library instead (no make);
KVRT_NO_BUNDLE=1 bundles nothing (the package then finds the library at run time).
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)


def log(msg):
    print(f"kvrt setup: {msg}", file=sys.stderr, flush=True)


def build_library():
    explicit = os.environ.get("KVRT_BUILD_LIBRARY")
    if explicit:
        if not os.path.exists(explicit):
            raise SystemExit(f"kvrt setup: KVRT_BUILD_LIBRARY={explicit}: no such file")
        return explicit
    mk = os.path.join(CHECKOUT, "Makefile")
    if not (os.path.exists(mk) and os.path.isdir(os.path.join(CHECKOUT, "runtime"))):
        log(f"no kvcc checkout at {CHECKOUT}: nothing bundled (set KVRT_LIBRARY at run time)")
        return None
    cmd = ["make", "-C", CHECKOUT, "--no-print-directory", "build/libkvrt.so",
           f"-j{os.cpu_count() or 1}"]
    if os.environ.get("KVRT_USE_CUDA") in ("0", "1"):
        cmd.append("USE_CUDA=" + os.environ["KVRT_USE_CUDA"])
    log("building the library: " + " ".join(cmd))
    subprocess.check_call(cmd)
    return os.path.join(CHECKOUT, "build", "libkvrt.so")


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        # setuptools reuses python/build/lib*/ between runs: what an earlier run bundled there
        # would ship again (a KVRT_NO_BUNDLE=1 wheel with a library in it, a CPU-only bundle
        # with an old CUDA backend beside it)
        shutil.rmtree(os.path.join(self.build_lib, "kvrt", "_native"), ignore_errors=True)
        if os.environ.get("KVRT_NO_BUNDLE") == "1":
            log("KVRT_NO_BUNDLE=1: no library bundled")
            return
        lib = build_library()
        if lib:
            dst = os.path.join(self.build_lib, "kvrt", "_native")
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(lib, os.path.join(dst, "libkvrt.so"))
            log(f"bundled {lib} as kvrt/_native/libkvrt.so")
            # a CUDA build's backend, which libkvrt loads from its own directory on first use
            cuda = os.path.join(os.path.dirname(lib), "libkvrt_cuda.so")
            if os.path.exists(cuda):
                shutil.copy2(cuda, os.path.join(dst, "libkvrt_cuda.so"))
                log(f"bundled {cuda} as kvrt/_native/libkvrt_cuda.so")


class BinaryDistribution(Distribution):
    """The wheel carries a native library: platform-specific, not pure Python."""

    def has_ext_modules(self):
        return True


CMDS = {"build_py": BuildPyWithLibrary}
try:  # setuptools >= 70.1 carries bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None
if bdist_wheel is not None:
    class BdistWheel(bdist_wheel):
        """py3-none-<platform>: the library is loaded through ctypes, not a CPython extension, so
        one wheel serves every Python 3 of that platform (it was tagged cp311-cp311)."""

        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    CMDS["bdist_wheel"] = BdistWheel

setup(cmdclass=CMDS, distclass=BinaryDistribution)
