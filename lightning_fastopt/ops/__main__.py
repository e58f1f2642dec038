"""``python -m lightning_fastopt.ops build`` / ``info``.

build  compile the kernels for this machine ahead of time (--all-isas: every instruction
       set this CPU can run, e.g. to test the portable build too; --cuda: the CUDA kernels
       too, for the visible GPUs or TORCH_CUDA_ARCH_LIST; --cuda-only: just those, e.g. to
       compile-check them on a machine with nvcc and a CUDA torch but no GPU)
info   which backend each kernel (and the optimizers that use it) runs on, the ISA, the
       GPU architectures, the cache paths, and any build error
clean  remove every build from the kernel cache (the next use rebuilds what it needs);
       a build another process is making right now is kept
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


def _build(args) -> int:
    from lightning_fastopt.ops.builder import ExtensionBuildError, build_dir, load_extension
    from lightning_fastopt.ops.cpu import cpu_extension_spec
    from lightning_fastopt.ops.isa import available_isas, detect_isa

    isas = [] if args.cuda_only else available_isas() if args.all_isas else [detect_isa().name]
    status = 0
    if args.cuda or args.cuda_only:
        status = _build_cuda()
    for isa in isas:
        spec = cpu_extension_spec(isa)
        start = time.perf_counter()
        try:
            load_extension(spec)
        except (ExtensionBuildError, OSError) as err:  # the lock's timeout is an OSError too
            print(f"cpu[{isa}]: build FAILED\n{err}", file=sys.stderr)
            status = 1
            continue
        print(f"cpu[{isa}]: ready in {time.perf_counter() - start:.1f} s at {build_dir(spec)}")
    return status


def _build_cuda() -> int:
    from lightning_fastopt.ops.builder import ExtensionBuildError, build_dir, load_extension
    from lightning_fastopt.ops.cuda import cuda_extension_spec

    start = time.perf_counter()
    try:
        spec = cuda_extension_spec()
        load_extension(spec)
    except (ExtensionBuildError, OSError) as err:
        print(f"cuda: build FAILED\n{err}", file=sys.stderr)
        return 1
    print(f"cuda[{spec.variant}]: ready in {time.perf_counter() - start:.1f} s at {build_dir(spec)}")
    return 0


def _state(spec) -> str:
    from lightning_fastopt.ops.builder import damage

    problem = damage(spec)
    if problem is None:
        return "built"
    return "not built yet" if problem == "not built" else f"damaged, rebuilt on first use: {problem}"


def _cuda_info() -> str:
    """How CUDA tensors are stepped, for `info` (builds the CUDA kernels if a GPU is visible)."""
    import torch

    from lightning_fastopt.ops import cuda_backend
    from lightning_fastopt.ops.builder import ExtensionBuildError, build_dir
    from lightning_fastopt.ops.cuda import cuda_extension_error, cuda_extension_spec, cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        print(f"CUDA extension: not applicable ({reason})")
        return "pure-PyTorch (no CUDA in this torch)"
    try:
        spec = cuda_extension_spec()
        print(f"CUDA extension: {build_dir(spec)} ({_state(spec)})")
    except ExtensionBuildError as err:
        print(f"CUDA extension: cannot be built here: {err}")
    if not torch.cuda.is_available():
        return "compiled CUDA kernels once a GPU is visible"
    ext = cuda_backend()  # builds if needed
    if ext is None:
        return f"torch fused / pure-PyTorch (CUDA kernels unavailable: {cuda_extension_error()})"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"compiled CUDA kernels ({names})"


def _info(args) -> int:
    import torch

    from lightning_fastopt.ops import BACKEND_ENV, KERNELS, CpuKernels, backend_choice, cpu_backend
    from lightning_fastopt.ops.builder import build_dir, cache_root, missing_tools
    from lightning_fastopt.ops.cpu import CUDA_ROUNDINGS_ENV, cpu_extension_error, cpu_extension_spec
    from lightning_fastopt.ops.isa import detect_isa

    isa = detect_isa()
    spec = cpu_extension_spec()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.get_num_threads()} CPU threads")
    print(f"CPU instruction set: {isa.name}")
    print(f"cache root: {cache_root()}")
    print(f"CPU extension: {build_dir(spec)} ({_state(spec)})")
    missing = missing_tools(spec)
    if missing:
        print("missing build tools: " + "; ".join(missing))
    print(f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV, '')!r} -> {backend_choice()}")
    with warnings.catch_warnings():  # a failed build's warning: its reason is printed below
        warnings.simplefilter("ignore", RuntimeWarning)
        backend = cpu_backend()
        backend = backend.full() if isinstance(backend, CpuKernels) else backend  # every piece, built if needed
    name = "compiled" if backend.isa != "torch" else "pure-PyTorch"
    error = cpu_extension_error()
    cuda_line = _cuda_info()
    for kernel, users in KERNELS.items():
        print(f"  {kernel:9s} ({', '.join(users)}) CPU tensors: {name} ({backend.isa}); CUDA tensors: {cuda_line}")
    if backend.isa != "torch":
        print("  Adam in torch's CUDA roundings (a GPU run's offloaded share): "
              + ("compiled" if backend.adam_cuda_roundings else
                 f"not in this build (no GPU visible): a call that asks for one builds the kernels that have them "
                 f"({CUDA_ROUNDINGS_ENV}=1 makes those the default)"))
    if error:
        print(f"build error:\n{error}")
    return 0


def _clean(args) -> int:
    from lightning_fastopt.ops.builder import cache_root, clean

    removed, busy, freed = clean()
    for path in removed:
        print(f"removed {path}")
    for path in busy:
        print(f"kept {path} (a build holds its lock)")
    print(f"freed {freed / 1e6:.1f} MB in {len(removed)} build(s) under {cache_root()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastopt.ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the kernels ahead of time")
    b.add_argument("--all-isas", action="store_true", help="build every instruction set this CPU can run")
    b.add_argument("--cuda", action="store_true", help="build the CUDA kernels too")
    b.add_argument("--cuda-only", action="store_true", help="build only the CUDA kernels")
    sub.add_parser("info", help="show backends, ISA, cache path and build errors")
    sub.add_parser("clean", help="remove every build from the kernel cache")
    args = parser.parse_args(argv)
    if args.command != "clean":  # cleaning needs no valid settings
        from lightning_fastopt.ops import check_environment

        try:
            check_environment()
        except ValueError as err:  # one line naming the variable, no traceback
            print(f"error: {err}", file=sys.stderr)
            return 2
    return {"build": _build, "info": _info, "clean": _clean}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
