"""``python -m lightning_fastopt.ops build`` / ``info``.

build  compile the kernels for this machine ahead of time (--all-isas: every instruction
       set this CPU can run, e.g. to test the portable build too)
info   which backend each optimizer uses, the ISA, the cache path, and any build error
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _build(args) -> int:
    from lightning_fastopt.ops.builder import ExtensionBuildError, build_dir, load_extension
    from lightning_fastopt.ops.cpu import cpu_extension_spec
    from lightning_fastopt.ops.isa import available_isas, detect_isa

    isas = available_isas() if args.all_isas else [detect_isa().name]
    status = 0
    for isa in isas:
        spec = cpu_extension_spec(isa)
        start = time.perf_counter()
        try:
            load_extension(spec)
        except ExtensionBuildError as err:
            print(f"cpu[{isa}]: build FAILED\n{err}", file=sys.stderr)
            status = 1
            continue
        print(f"cpu[{isa}]: ready in {time.perf_counter() - start:.1f} s at {build_dir(spec)}")
    return status


def _info(args) -> int:
    import torch

    from lightning_fastopt.ops import BACKEND_ENV, backend_choice, cpu_backend
    from lightning_fastopt.ops.builder import build_dir, cache_root, is_built, missing_tools
    from lightning_fastopt.ops.cpu import cpu_extension_error, cpu_extension_spec
    from lightning_fastopt.ops.isa import detect_isa

    isa = detect_isa()
    spec = cpu_extension_spec()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.get_num_threads()} CPU threads")
    print(f"CPU instruction set: {isa.name}")
    print(f"cache root: {cache_root()}")
    print(f"CPU extension: {build_dir(spec)} ({'built' if is_built(spec) else 'not built yet'})")
    missing = missing_tools(spec)
    if missing:
        print("missing build tools: " + "; ".join(missing))
    print(f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV, '')!r} -> {backend_choice()}")
    backend = cpu_backend()  # builds if needed
    name = "compiled" if backend.isa != "torch" else "pure-PyTorch"
    error = cpu_extension_error()
    from lightning_fastopt import optim

    for cls in optim.__all__:
        if cls == "FusedOptimizer":
            continue
        print(f"  {cls:13s} CPU tensors: {name} ({backend.isa}); CUDA tensors: pure-PyTorch (torch ops)")
    if error:
        print(f"build error:\n{error}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastopt.ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the kernels ahead of time")
    b.add_argument("--all-isas", action="store_true", help="build every instruction set this CPU can run")
    sub.add_parser("info", help="show backends, ISA, cache path and build errors")
    args = parser.parse_args(argv)
    return _build(args) if args.command == "build" else _info(args)


if __name__ == "__main__":
    sys.exit(main())
