"""Check a built GPU library's exports against its public header (CPU only, no GPU, no CUDA).

    python scripts/check_abi.py                       # moonep_ops/lib/: the production libraries
    python scripts/check_abi.py --diagnostics         # moonep_ops/lib/diagnostics/
    python scripts/check_abi.py --lib-dir DIR         # libraries elsewhere
    python scripts/check_abi.py --markdown            # print the prototype tables, check nothing

The headers are csrc/moonep_ep.h (libmoonep_ep.so) and cutlass_kernels/moonep_gemm.h
(libmoonep_gemm.so).  A prototype is a MOONEP_EXPORT / MOONEP_API declaration; one inside
``#ifdef MOONEP_DIAGNOSTICS`` belongs to the diagnostics build only.  For each library found:
  * every exported (defined, dynamic) symbol has a prototype of its build;
  * every prototype of its build is exported;
  * a production library exports no diagnostics symbol;
and, library or not, each header's ABI version (MOONEP_*_ABI_VERSION) is the one
moonep_ops/native.py expects (GEMM_ABI_VERSION, EP_ABI_VERSION; native.py refuses a library that
reports another).
The exports are read with ``nm -D --defined-only`` (binutils), or from the ELF .dynsym table
directly where nm is missing.  The compiler checks that each definition matches its prototype
(every .cu file includes its library's header).  Exit status 0: all checks pass; 1: a check
failed; 2: no library to check.
"""
from __future__ import annotations

import argparse
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBS = {  # library file -> its public header
    "libmoonep_ep.so": ROOT / "csrc" / "moonep_ep.h",
    "libmoonep_gemm.so": ROOT / "cutlass_kernels" / "moonep_gemm.h",
}
VERSIONS = {  # header macro -> the moonep_ops/native.py constants it may equal (native.py
    # accepts a libmoonep_gemm.so of ABI 8, the bf16 GEMMs, 10, those plus the FP8 GEMM, or
    # 11, those plus the MOONEP_GEMM_KEEP_TAIL flag, or 12, those plus the FP8 wgrad GEMM)
    "MOONEP_EP_ABI_VERSION": ("EP_ABI_VERSION",),
    "MOONEP_GEMM_ABI_VERSION": ("GEMM_ABI_VERSION", "GEMM_FP8_ABI_VERSION",
                                "GEMM_KEEP_TAIL_ABI_VERSION", "GEMM_FP8_WGRAD_ABI_VERSION"),
}
NATIVE_PY = ROOT / "moonep_ops" / "native.py"
DIAG_MACRO = "MOONEP_DIAGNOSTICS"


@dataclass
class Proto:
    name: str
    ret: str
    args: list[tuple[str, str]]   # (C type, name)
    diagnostics: bool

    def c(self) -> str:
        return f"{self.ret} {self.name}({', '.join(f'{t} {n}' for t, n in self.args) or 'void'})"


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _split_arg(arg: str) -> tuple[str, str]:
    arg = " ".join(arg.split())
    m = re.match(r"^(.*?[\s*])([A-Za-z_]\w*)$", arg)
    if not m:
        raise ValueError(f"cannot parse argument {arg!r}")
    typ = re.sub(r"\s*\*", "*", m.group(1).strip())
    typ = re.sub(r"\*(?=[A-Za-z_])", "* ", typ)      # "const void* const*"
    return typ, m.group(2)


def parse_header(path: Path) -> dict[str, Proto]:
    """Every MOONEP_EXPORT / MOONEP_API prototype of a header, by name."""
    text = _strip_comments(path.read_text())
    # Which lines are inside #ifdef MOONEP_DIAGNOSTICS (nesting of #if*/#endif tracked).
    stack: list[bool] = []
    keep: list[str] = []
    diag_lines: list[bool] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            d = s[1:].strip()
            if d.startswith("if"):
                stack.append(d.split()[:2] == ["ifdef", DIAG_MACRO]
                             or d.replace(" ", "").startswith(f"ifdefined({DIAG_MACRO})"))
            elif d.startswith("endif"):
                stack.pop()
            elif d.startswith("else") or d.startswith("elif"):
                if stack and stack[-1]:
                    stack[-1] = False                # the non-diagnostics branch
            keep.append("")
            diag_lines.append(any(stack))
            continue
        keep.append(line)
        diag_lines.append(any(stack))
    body = "\n".join(keep)
    protos: dict[str, Proto] = {}
    pat = re.compile(r"\b(?:MOONEP_EXPORT|MOONEP_API)\s+([^;{}()]*?)\b(moonep_\w+)\s*\(([^)]*)\)\s*;",
                     re.S)
    for m in pat.finditer(body):
        line_no = body.count("\n", 0, m.start())
        raw_args = " ".join(m.group(3).split())
        args = [] if raw_args in ("", "void") else [_split_arg(a) for a in raw_args.split(",")]
        name = m.group(2)
        if name in protos:
            raise ValueError(f"{path}: {name} declared twice")
        ret = re.sub(r"\s*\*", "*", " ".join(m.group(1).split()))
        protos[name] = Proto(name, ret, args, diag_lines[line_no])
    return protos


def _elf_dynamic_symbols(path: Path) -> set[str]:
    """Defined global/weak symbols of an ELF64 little-endian .dynsym (the fallback for nm)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out: set[str] = set()
    for sh in sections:
        if sh[1] != 11:                                # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        for off in range(sh[4], sh[4] + sh[5], 24):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, off)
            if st_shndx == 0 or (st_info >> 4) not in (1, 2) or st_name == 0:
                continue                               # undefined, local, or unnamed
            end = data.index(b"\0", str_off + st_name)
            out.add(data[str_off + st_name:end].decode())
    return out


def exported_symbols(path: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm:
        r = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            syms = set()
            for line in r.stdout.splitlines():
                parts = line.split()
                if len(parts) >= 3:
                    syms.add(parts[2].split("@")[0])
            return syms
    return _elf_dynamic_symbols(path)


def check(lib: Path, header: Path, diagnostics: bool) -> list[str]:
    protos = parse_header(header)
    want = {n for n, p in protos.items() if diagnostics or not p.diagnostics}
    diag = {n for n, p in protos.items() if p.diagnostics}
    got = exported_symbols(lib)
    problems = []
    for s in sorted(got - set(protos)):
        problems.append(f"{lib.name}: exports {s}, which has no prototype in {header.name}")
    for s in sorted(got & diag if not diagnostics else set()):
        problems.append(f"{lib.name}: production build exports the diagnostics symbol {s}")
    for s in sorted(want - got):
        problems.append(f"{lib.name}: {s} is declared in {header.name} but not exported")
    return problems


def check_versions() -> list[str]:
    """Each header's ABI version against moonep_ops/native.py's expectation (source text only)."""
    native = NATIVE_PY.read_text()
    problems = []
    for header in LIBS.values():
        for macro, consts in VERSIONS.items():
            m = re.search(rf"#define\s+{macro}\s+(\d+)", header.read_text())
            if not m:
                continue
            found = {c: n.group(1) for c in consts
                     if (n := re.search(rf"^{c}\s*=\s*(\d+)", native, re.M))}
            if not found:
                problems.append(f"{NATIVE_PY.name}: no {' / '.join(consts)} (the header has "
                                f"{macro} {m.group(1)})")
            elif m.group(1) not in found.values():
                want = ", ".join(f"{c} = {v}" for c, v in found.items())
                problems.append(f"{header.name}: {macro} {m.group(1)}, but {NATIVE_PY.name} "
                                f"expects one of {want}")
    return problems


def markdown() -> str:
    out = []
    for lib, header in LIBS.items():
        protos = parse_header(header)
        for diag in (False, True):
            rows = [p for p in protos.values() if p.diagnostics == diag]
            if not rows:
                continue
            out.append(f"### {lib}{' (diagnostics build only)' if diag else ''}\n")
            out.append("| # | name | returns | arguments (C type name, in order) |")
            out.append("|---|---|---|---|")
            for i, p in enumerate(rows, 1):
                args = ", ".join(f"`{t} {n}`" for t, n in p.args) or "(none)"
                out.append(f"| {i} | `{p.name}` | `{p.ret}` | {args} |")
            out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib-dir", type=Path, default=None)
    ap.add_argument("--diagnostics", action="store_true",
                    help="the libraries are a --diagnostics build (default dir: lib/diagnostics)")
    ap.add_argument("--markdown", action="store_true", help="print the prototype tables and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    lib_dir = args.lib_dir or (ROOT / "moonep_ops" / "lib" / ("diagnostics" if args.diagnostics else ""))
    versions = check_versions()
    found = [(lib_dir / name, header) for name, header in LIBS.items() if (lib_dir / name).exists()]
    if not found:
        for p in versions:
            print("  " + p)
        print(f"no library in {lib_dir} (build it with python -m moonep_ops.build"
              f"{' --diagnostics' if args.diagnostics else ''})", file=sys.stderr)
        return 1 if versions else 2
    print(f"ABI versions: {'OK' if not versions else f'{len(versions)} problem(s)'}")
    problems = list(versions)
    for lib, header in found:
        n = len(exported_symbols(lib))
        p = check(lib, header, args.diagnostics)
        problems += p
        print(f"{lib}: {n} exports, {'OK' if not p else f'{len(p)} problem(s)'}")
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
