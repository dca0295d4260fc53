"""Build the GPU shared libraries: ``python -m moonep_ops.build [--check] [--diagnostics] [-j N]``.

Compiles with nvcc for sm_90a into two libraries (CUDA runtime linked statically, plain C ABI:
no torch, so one binary serves every torch / Python version).  Installing the package never
runs this.
  ``cutlass_kernels/*.cu`` -> ``moonep_ops/lib/libmoonep_gemm.so``  (CUTLASS grouped GEMMs)
  ``csrc/*.cu``            -> ``moonep_ops/lib/libmoonep_ep.so``    (the GPU data plane)
Public C ABI: ``cutlass_kernels/moonep_gemm.h`` and ``csrc/moonep_ep.h``
(``python scripts/check_abi.py`` compares a built library's exports with them).

  --check      compile every translation unit to a temporary directory and link nothing
               (the CI compile check: catches a broken kernel build without a GPU);
  -j N         parallel nvcc jobs (default 1: each CUTLASS unit takes ~1 min and ~2 GB);
  --only PATS  compile only units whose file name contains one of the comma-separated PATS
               (the link still takes every unit's cached object);
  --lib NAME   build only one library: gemm or ep (default: both);
  --diagnostics  compile with -DMOONEP_DIAGNOSTICS: the planner's debug hooks
               (moonep_plan_debug_*) and the kernels' clock64 stamps (moonep_ep.h,
               moonep_gemm.h, diagnostics/README.md).  The libraries go to
               ``moonep_ops/lib/diagnostics/`` (objects to ``build/moonep_gpu_diagnostics/``),
               so they never replace the production ones; load them with
               ``MOONEP_LIB_DIR=moonep_ops/lib/diagnostics``.

CUTLASS headers: ``$CUTLASS_INCLUDE`` (a CUTLASS ``include`` directory; ``tools/util/include``
is looked up beside it), else the ``nvidia-cutlass`` pip package
(``cutlass_library/source/include``; ``pip install --no-deps nvidia-cutlass==4.2.0.0``, 6 MB).
nvcc: ``$NVCC``, else ``nvcc`` on PATH.  Object files are cached in ``build/moonep_gpu/`` and
rebuilt when the source or any header of its folder is newer, or when the nvcc command line
changed (a different nvcc, CUTLASS or flags).
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import settings

ROOT = Path(__file__).resolve().parent.parent
LIB_DIR = Path(__file__).resolve().parent / "lib"
DIAG_LIB_DIR = LIB_DIR / "diagnostics"
DIAG_DEFINE = "-DMOONEP_DIAGNOSTICS"
ARCH = ["-gencode", "arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
              "-Xcompiler", "-fvisibility=hidden"]


def cutlass_includes() -> list[Path]:
    env = settings.get("CUTLASS_INCLUDE")
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
    exe = settings.get("NVCC") or shutil.which("nvcc")
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


def compile_cmd(src: Path, obj: Path, includes: list[Path], defines: list[str]) -> list[str]:
    return [nvcc(), *NVCC_FLAGS, *defines, *ARCH, *[f"-I{i}" for i in includes],
            f"-I{src.parent}", "-c", str(src), "-o", str(obj)]


def _cmd_file(obj: Path) -> Path:
    return obj.with_suffix(".cmd")


def _cmd_changed(obj: Path, cmd: list[str]) -> bool:
    f = _cmd_file(obj)
    return not f.exists() or f.read_text() != " ".join(cmd)


def compile_one(src: Path, obj: Path, includes: list[Path], defines: list[str],
                verbose: bool) -> tuple[Path, float]:
    cmd = compile_cmd(src, obj, includes, defines)
    if verbose:
        cmd[1:1] = ["-Xptxas", "-v"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src.name}:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    if verbose and r.stderr:
        print(r.stderr)
    _cmd_file(obj).write_text(" ".join(compile_cmd(src, obj, includes, defines)))
    return src, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compile only, into a temp dir")
    ap.add_argument("-j", type=int, default=1)
    ap.add_argument("--only", default=None)
    ap.add_argument("--verbose", action="store_true", help="ptxas resource usage")
    ap.add_argument("--lib", choices=sorted(LIBS), default=None)
    ap.add_argument("--diagnostics", action="store_true",
                    help="-DMOONEP_DIAGNOSTICS, into moonep_ops/lib/diagnostics/")
    args = ap.parse_args(argv)

    libs = [args.lib] if args.lib else sorted(LIBS)
    includes = cutlass_includes() if "gemm" in libs else []
    tmp = tempfile.TemporaryDirectory() if args.check else None
    cache = "moonep_gpu_diagnostics" if args.diagnostics else "moonep_gpu"
    obj_dir = Path(tmp.name) if tmp else ROOT / "build" / cache
    obj_dir.mkdir(parents=True, exist_ok=True)
    rc = 0
    for lib in libs:
        rc = rc or _build(lib, args, includes, obj_dir)
    return rc


def _build(lib: str, args, includes: list[Path], obj_dir: Path) -> int:
    srcs = sources(lib)
    if not srcs:
        raise SystemExit(f"no sources for {lib}")
    defines = [DIAG_DEFINE] if args.diagnostics else []
    jobs = [(s, obj_dir / (s.stem + ".o")) for s in srcs]
    todo = [(s, o) for s, o in jobs
            if (args.check or _stale(s, o) or _cmd_changed(o, compile_cmd(s, o, includes, defines)))
            and (not args.only or any(p in s.name for p in args.only.split(",") if p))]
    t0 = time.time()
    inc = f"CUTLASS: {includes[0]}  " if includes else ""
    variant = "diagnostics" if args.diagnostics else "production"
    print(f"[{lib}] {variant}  nvcc: {nvcc()}  {inc}units: {len(todo)}/{len(jobs)}  -j{args.j}",
          flush=True)
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.j)) as ex:
            futs = [ex.submit(compile_one, s, o, includes, defines, args.verbose) for s, o in todo]
            for f in futs:
                src, dt = f.result()
                print(f"  {src.name}: {dt:.0f} s", flush=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if args.check:
        print(f"[{lib}] compile check OK ({time.time() - t0:.0f} s)")
        return 0
    lib_dir = DIAG_LIB_DIR if args.diagnostics else LIB_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    out = lib_dir / LIBS[lib][1]
    # Export the C ABI (moonep_*) and nothing else: -fvisibility=hidden does not cover the
    # C++ library's inline functions that some headers instantiate with default visibility
    # (std::ctype<char>::do_widen in the CUTLASS units), and scripts/check_abi.py requires every
    # export to have a prototype.
    vscript = obj_dir / f"{LIBS[lib][1]}.map"
    vscript.write_text("{\n  global: moonep_*;\n  local: *;\n};\n")
    cmd = [nvcc(), "-shared", *ARCH, "-cudart", "static", "-Xlinker", f"--version-script={vscript}",
           "-o", str(out), *[str(o) for _, o in jobs]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"link failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
