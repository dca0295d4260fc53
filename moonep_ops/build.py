"""Build the GPU shared libraries: ``python -m moonep_ops.build [--check] [-j N] [--only PAT]``.

Compiles with nvcc for sm_90a into two libraries (CUDA runtime linked statically, plain C ABI:
no torch, so one binary serves every torch / Python version).  Installing the package never
runs this.
  ``cutlass_kernels/*.cu`` -> ``moonep_ops/lib/libmoonep_gemm.so``  (CUTLASS grouped GEMMs)
  ``csrc/*.cu``            -> ``moonep_ops/lib/libmoonep_ep.so``    (the GPU data plane)

  --check      compile every translation unit to a temporary directory and link nothing
               (the CI compile check: catches a broken kernel build without a GPU);
  -j N         parallel nvcc jobs (default 1: each CUTLASS unit takes ~1 min and ~2 GB);
  --only PAT   compile only units whose file name contains PAT (the link still takes every
               unit's cached object);
  --lib NAME   build only one library: gemm or ep (default: both).

CUTLASS headers: ``$CUTLASS_INCLUDE`` (a CUTLASS ``include`` directory; ``tools/util/include``
is looked up beside it), else the ``nvidia-cutlass`` pip package
(``cutlass_library/source/include``; ``pip install --no-deps nvidia-cutlass==4.2.0.0``, 6 MB).
nvcc: ``$NVCC``, else ``nvcc`` on PATH.  Object files are cached in ``build/moonep_gpu/`` and
rebuilt when the source or any header in ``cutlass_kernels/`` is newer.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB_DIR = Path(__file__).resolve().parent / "lib"
ARCH = ["-gencode", "arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
              "-Xcompiler", "-fvisibility=hidden"]


def cutlass_includes() -> list[Path]:
    env = os.environ.get("CUTLASS_INCLUDE")
    if env:
        inc = Path(env)
        util = inc.parent / "tools" / "util" / "include"
        return [inc] + ([util] if util.exists() else [])
    spec = importlib.util.find_spec("cutlass_library")  # no import: that pulls the generator
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("CUTLASS headers not found: set CUTLASS_INCLUDE or "
                         "`pip install --no-deps nvidia-cutlass==4.2.0.0`")
    src = Path(list(spec.submodule_search_locations)[0]) / "source"
    return [src / "include", src / "tools" / "util" / "include"]


def nvcc() -> str:
    exe = os.environ.get("NVCC") or shutil.which("nvcc")
    if not exe:
        raise SystemExit("nvcc not found (set NVCC or put it on PATH)")
    return exe


LIBS = {"gemm": ("cutlass_kernels", "libmoonep_gemm.so"), "ep": ("csrc", "libmoonep_ep.so")}


def sources(lib: str) -> list[Path]:
    folder = ROOT / LIBS[lib][0]
    return sorted(folder.glob("*.cu")) if folder.is_dir() else []


def _stale(src: Path, obj: Path) -> bool:
    if not obj.exists():
        return True
    # every header of the folder: *.h, *.hpp and *.cuh (a "*.h*" glob missed *.cuh)
    headers = [h for h in src.parent.iterdir() if h.suffix in (".h", ".hpp", ".cuh")]
    newest = max([src.stat().st_mtime] + [h.stat().st_mtime for h in headers])
    return newest > obj.stat().st_mtime


def compile_one(src: Path, obj: Path, includes: list[Path], verbose: bool) -> tuple[Path, float]:
    cmd = [nvcc(), *NVCC_FLAGS, *ARCH, *[f"-I{i}" for i in includes], f"-I{src.parent}",
           "-c", str(src), "-o", str(obj)]
    if verbose:
        cmd[1:1] = ["-Xptxas", "-v"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src.name}:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    if verbose and r.stderr:
        print(r.stderr)
    return src, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compile only, into a temp dir")
    ap.add_argument("-j", type=int, default=1)
    ap.add_argument("--only", default=None)
    ap.add_argument("--verbose", action="store_true", help="ptxas resource usage")
    ap.add_argument("--lib", choices=sorted(LIBS), default=None)
    args = ap.parse_args(argv)

    libs = [args.lib] if args.lib else sorted(LIBS)
    includes = cutlass_includes() if "gemm" in libs else []
    tmp = tempfile.TemporaryDirectory() if args.check else None
    obj_dir = Path(tmp.name) if tmp else ROOT / "build" / "moonep_gpu"
    obj_dir.mkdir(parents=True, exist_ok=True)
    rc = 0
    for lib in libs:
        rc = rc or _build(lib, args, includes, obj_dir)
    return rc


def _build(lib: str, args, includes: list[Path], obj_dir: Path) -> int:
    srcs = sources(lib)
    if not srcs:
        raise SystemExit(f"no sources for {lib}")
    jobs = [(s, obj_dir / (s.stem + ".o")) for s in srcs]
    todo = [(s, o) for s, o in jobs if (args.check or _stale(s, o))
            and (not args.only or args.only in s.name)]
    t0 = time.time()
    inc = f"CUTLASS: {includes[0]}  " if includes else ""
    print(f"[{lib}] nvcc: {nvcc()}  {inc}units: {len(todo)}/{len(jobs)}  -j{args.j}", flush=True)
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.j)) as ex:
            futs = [ex.submit(compile_one, s, o, includes, args.verbose) for s, o in todo]
            for f in futs:
                src, dt = f.result()
                print(f"  {src.name}: {dt:.0f} s", flush=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if args.check:
        print(f"[{lib}] compile check OK ({time.time() - t0:.0f} s)")
        return 0
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    out = LIB_DIR / LIBS[lib][1]
    cmd = [nvcc(), "-shared", *ARCH, "-cudart", "static", "-o", str(out), *[str(o) for _, o in jobs]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"link failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
