#!/usr/bin/env python3
"""Compiles moeflux's CUDA kernels with NVRTC on a machine without a GPU, as
the CUDA backend does at run time (the sources of
crates/moeflux/src/backend/cuda/compile.rs, in its order, one program, with
the launch geometry of geometry.rs as -D options), and prints NVRTC's log.
Needs libnvrtc: `pip install nvidia-cuda-nvrtc` puts it in
site-packages/nvidia/cu13/lib, which this script finds; or pass --lib PATH
(its libnvrtc-builtins is loaded from the same folder).

NVRTC releases differ in what they accept (13.5 compiles a generic lambda
in device code that 13.0 refuses): check with CUDA 13.0's as well, e.g.
`pip download --no-deps nvidia-cuda-nvrtc==13.0.*`, unzip the wheel and
pass --lib .../nvidia/cu13/lib/libnvrtc.so.13.

    python3 tools/nvrtc_check.py [--arch sm_90] [-D NAME=VALUE ...] [--ptxas REGEX]

--ptxas prints ptxas's registers, stack and spills of the kernels whose
names match REGEX (a real architecture such as sm_90 compiles to a CUBIN).

-D adds tuning defines as MOEFLUX_CUDA_DEFINES does; like it, it may not
set a constant of geometry.rs.
"""
import argparse
import ctypes
import glob
import os
import re
import site
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CUDA = os.path.join(ROOT, "crates/moeflux/src/backend/cuda")


def find_lib():
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for path in glob.glob(os.path.join(base, "nvidia/*/lib/libnvrtc.so*")):
            if "builtins" not in path:
                return path
    return "libnvrtc.so"


def program():
    compile_rs = open(os.path.join(CUDA, "compile.rs")).read()
    names = re.findall(r'include_str!\("kernels/([\w.]+)"\)', compile_rs)
    return "".join(
        f'#line 1 "{n}"\n{open(os.path.join(CUDA, "kernels", n)).read()}\n' for n in names
    )


def geometry():
    """geometry.rs's constants as (name, value): its `NAME: type = digits;`
    lines (compile.rs's test the_nvrtc_check_reads_the_same_geometry holds
    the file to that form)."""
    text = open(os.path.join(CUDA, "geometry.rs")).read()
    found = re.findall(r"^\s*([A-Z][A-Z0-9_]*):\s*([a-z0-9]+)\s*=\s*([0-9_]+);\s*$", text, re.M)
    if not found:
        sys.exit("no constants found in geometry.rs")
    return [(name, value.replace("_", "")) for name, _, value in found]


def ptxas_summary(log, pattern):
    """One line per kernel matching `pattern` from ptxas's verbose log: its
    registers, stack frame and spills; NVRTC's other messages unchanged."""
    lines, kernel, out = log.splitlines(), None, []
    for line in lines:
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            kernel = entry.group(1)
            continue
        if not line.startswith("ptxas"):
            out.append(line)
        elif kernel and pattern.search(kernel):
            stats = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
            regs = re.search(r"Used (\d+) registers", line)
            if stats:
                out.append(f"{kernel}: stack {stats.group(1)} B, spill stores {stats.group(2)} B")
            if regs:
                out.append(f"{kernel}: {regs.group(1)} registers")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--lib", default=None)
    parser.add_argument("-D", dest="defines", action="append", default=[])
    parser.add_argument("--ptxas", metavar="REGEX", default=None)
    parser.add_argument("--cubin", metavar="PATH", default=None,
                        help="write the CUBIN there (for nvdisasm; a real architecture only)")
    args = parser.parse_args()
    if args.lib:
        # NVRTC opens its builtins by name; load the ones beside --lib first.
        for path in glob.glob(os.path.join(os.path.dirname(args.lib), "libnvrtc-builtins.so*")):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
    nvrtc = ctypes.CDLL(args.lib or find_lib())
    prog = ctypes.c_void_p()
    source = program().encode()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed: {rc}")
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"moeflux.cu", 0, None, None),
          "nvrtcCreateProgram")
    defines = geometry()
    for d in args.defines:
        if d.split("=")[0] in dict(defines):
            sys.exit(f"-D {d}: launch geometry comes from geometry.rs only")
    options = [f"--gpu-architecture={args.arch}".encode()] + [
        f"-D{name}={value}".encode() for name, value in defines
    ] + [f"-D{d}".encode() for d in args.defines]
    if args.ptxas:
        options.append(b"--ptxas-options=--verbose")
    array = (ctypes.c_char_p * len(options))(*options)
    rc = nvrtc.nvrtcCompileProgram(prog, len(options), array)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if args.ptxas:
        text = ptxas_summary(text, re.compile(args.ptxas))
    if text:
        print(text)
    if rc == 0 and args.cubin:
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        with open(args.cubin, "wb") as f:
            f.write(cubin.raw)
    print(f"NVRTC: {'compiled' if rc == 0 else 'FAILED'} for {args.arch}")
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
