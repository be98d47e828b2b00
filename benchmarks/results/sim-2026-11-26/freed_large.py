"""Large blocks freed among live ones, then empty_cache: what each policy keeps (see README.md).

Run from the root of a checkout (with rules.patch applied, its switches in the environment, to
see them: ``NP_BIG=2 python benchmarks/results/sim-2026-11-26/freed_large.py``). Every figure is
the simulator's, under CUDA's request rules and torch_npu's (a request padded by 32 bytes).
"""
import os
import sys

sys.path[:0] = [os.getcwd()]
from npu_pool import OutOfMemoryError, Pool  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def ten_on_one_gib(policy: str, rules: str) -> str:
    """Ten 100 MiB blocks on a 1 GiB device, every other one freed, empty_cache, then 300 MiB."""
    with Pool(policy, capacity=GiB, rules=rules) as p:
        ptrs = [p.malloc(100 * MiB) for _ in range(10)]
        for x in ptrs[::2]:
            p.free(x)
        p.empty_cache()
        reserved = p.stats()["total"]["reserved"]["current"] // MiB
        try:
            p.free(p.malloc(300 * MiB))
            served = "served"
        except OutOfMemoryError:
            served = "out of memory"
        return f"reserved {reserved} MiB for 500 live, 300 MiB {served}"


def half_of_four_gib(policy: str, rules: str, size_mib: int) -> int:
    """Half of a 4 GiB device in blocks of size_mib, every other one freed, empty_cache: MiB
    reserved beyond the live bytes."""
    with Pool(policy, capacity=4 * GiB, rules=rules) as p:
        ptrs = [p.malloc(size_mib * MiB) for _ in range(2 * GiB // (size_mib * MiB))]
        for x in ptrs[::2]:
            p.free(x)
        p.empty_cache()
        st = p.stats()["total"]
        return (st["reserved"]["current"] - st["allocated"]["current"]) // MiB


def main() -> None:
    for rules in ("cuda", "npu"):
        for policy in ("npu_pool", "torch"):
            print(f"{rules:4s} {policy:8s} 10 x 100 MiB on 1 GiB: {ten_on_one_gib(policy, rules)}")
        for policy in ("npu_pool", "torch"):
            kept = [half_of_four_gib(policy, rules, s) for s in (20, 40, 64, 100, 200)]
            print(f"{rules:4s} {policy:8s} half of 4 GiB in 20/40/64/100/200 MiB blocks, kept beyond live (MiB): {kept}")


if __name__ == "__main__":
    main()
