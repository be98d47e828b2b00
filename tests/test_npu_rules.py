"""torch_npu's request rules (`--device npu`): every request rounds up to 32 bytes and gets 32 more
before the allocator sees it (AddPadSize in torch_npu's NPUCachingAllocator.cpp), for every
policy; the ACL backend pads under torch_npu's own condition; replays follow the trace's device
type, which the snapshot importer reads from the recording allocator's frames."""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from npu_pool.cli import main as cli
from npu_pool.pool import InvalidArgumentError, Pool
from npu_pool.replay import evaluate, run
from npu_pool.trace.format import OP_ALLOC, OP_FREE, Trace, device_type, forced_device
from npu_pool.trace.snapshot import snapshot_to_traces
from npu_pool._core import ffi, lib
from conftest import unavailable

KiB, MiB = 1 << 10, 1 << 20
FAKES = Path(__file__).parent / "fake_vendor"


def npu_block(r: int) -> int:
    """torch_npu's block for a request of r bytes: pad to round_up(r, 32) + 32, then 512-byte rounding."""
    padded = -(-r // 32) * 32 + 32
    return max(512, -(-padded // 512) * 512)


@pytest.mark.parametrize("policy", ["torch", "expandable", "npu_pool"])
def test_npu_rules_pad_every_request_for_every_policy(policy: str) -> None:
    sizes = [1, 31, 32, 448, 480, 481, 512, 1000, 4096, MiB - 33, MiB - 32, MiB, 5 * MiB + 1]
    for rules, block in (("npu", npu_block), ("cuda", lambda r: max(512, -(-r // 512) * 512))):
        with Pool(policy, rules=rules) as p:
            ptrs = [p.malloc(s) for s in sizes]
            got = {b["addr"]: b["size"] for b in p.blocks() if b["allocated"]}
            assert [got[a] for a in ptrs] == [block(s) for s in sizes], rules
            assert p.stats()["total"]["requested"]["current"] == sum(sizes)  # callers' bytes stay theirs
            p.check()


def test_padding_moves_requests_across_the_small_large_boundary() -> None:
    """1 MiB - 31 bytes is a small request on CUDA and a large one (a 20 MiB segment) on the NPU;
    10 MiB - 543 bytes shares a 20 MiB segment on CUDA and gets a 10 MiB one of its own on the NPU."""
    for size, cuda_seg, npu_seg in ((MiB - 32, 2 * MiB, 2 * MiB), (MiB - 31, 2 * MiB, 20 * MiB),
                                    (MiB, 2 * MiB, 20 * MiB), (10 * MiB - 544, 20 * MiB, 20 * MiB),
                                    (10 * MiB - 543, 20 * MiB, 10 * MiB)):
        for rules, seg in (("cuda", cuda_seg), ("npu", npu_seg)):
            with Pool("torch", rules=rules) as p:
                p.malloc(size)
                assert p.stats()["total"]["reserved"]["current"] == seg, (size, rules)


@pytest.mark.parametrize("policy", ["torch", "expandable", "npu_pool"])
def test_the_simulators_own_rules_count_as_cudas(policy: str) -> None:
    """rules="auto" on the simulated device is CUDA's (device_rules says so): the same calls kind by
    kind, cudaFree's own wait included. It counted a synchronisation before each free, as
    aclrtFree's caller makes, where rules="cuda" counted none (a review, 2026-11-27)."""
    def calls(rules: str) -> dict[str, int]:
        with Pool(policy, capacity=64 * MiB, rules=rules) as p:
            a = p.malloc(40 * MiB)
            p.free(a)
            p.malloc(10 * MiB)
            with pytest.raises(MemoryError):
                p.malloc(60 * MiB)
            p.empty_cache()
            return {k: v for k, v in p.stats()["calls"].items() if v}

    auto = calls("auto")
    assert Pool(policy, rules="auto").device_rules == "cuda"
    assert auto == calls("cuda") and auto != calls("npu")


def test_a_fraction_of_one_caps_cuda_and_not_torch_npu() -> None:
    """torch_npu's setMemoryFraction sets a maximum only below 1.0: at 1.0 a request past the
    device is asked of it (refused: a malloc, the cache freed, a second malloc), where CUDA's
    allocator caps itself at the device's size and asks nothing. The model capped under both (a
    review against torch_npu's source and the live allocator, 2026-11-27)."""
    for rules, mallocs in (("npu", 2), ("cuda", 0)):
        with Pool("torch", capacity=30 * MiB, rules=rules) as p:
            p.set_fraction(1.0)
            with pytest.raises(MemoryError):
                p.malloc(40 * MiB)
            assert p.stats()["calls"]["malloc"] == mallocs, rules
        with Pool("torch", capacity=30 * MiB, rules=rules) as p:  # below 1.0: a cap under both
            p.set_fraction(0.5)
            with pytest.raises(MemoryError):
                p.malloc(20 * MiB)
            assert p.stats()["calls"]["malloc"] == 0, rules


def test_rules_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown device rules 'tpu'"):
        Pool("torch", rules="tpu")
    cfg = ffi.new("np_config *")
    lib.np_config_init(cfg)
    cfg.device_rules = 7
    out = ffi.new("np_ctx **")
    assert lib.np_create(cfg, out) == lib.NP_ERR_INVALID
    assert "unknown device rules 7" in ffi.string(lib.np_last_error()).decode()


def _mib_trace(device: str | None = None) -> Trace:
    """Eight live 1 MiB tensors: CUDA packs them two by two in 2 MiB small segments, torch_npu (padded past
    1 MiB) in one 20 MiB large segment."""
    t = Trace(meta={"origin": "mib", "n_ids": 8})
    if device:
        t.meta["device_type"] = device
    for i in range(8):
        t.append(OP_ALLOC, id=i, size=MiB)
    for i in range(8):
        t.append(OP_FREE, id=i, size=MiB)
    return t


def test_replay_follows_the_trace_device_unless_told() -> None:
    cuda, npu = 8 * MiB, 20 * MiB
    assert run(_mib_trace(), "torch").peak_reserved_bytes == cuda  # a trace that does not say: CUDA's rules
    assert run(_mib_trace("cuda"), "torch").peak_reserved_bytes == cuda
    assert run(_mib_trace("npu"), "torch").peak_reserved_bytes == npu
    assert run(_mib_trace("npu"), "torch", device="cuda").peak_reserved_bytes == cuda
    with forced_device("npu"):
        assert run(_mib_trace("cuda"), "torch").peak_reserved_bytes == npu
        assert evaluate(_mib_trace(), "mib", "torch").min_capacity_bytes == npu
    assert device_type(_mib_trace()) == "cuda"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        device_type(_mib_trace(), "tpu")


def _snapshot(frame_name: str | None, settings: bool = False, filename: str = "x.cpp") -> dict:
    frames = [{"filename": filename, "line": 0, "name": frame_name}] if frame_name else []
    ev = lambda action, addr, size: {"action": action, "addr": addr, "size": size, "stream": 0,  # noqa: E731
                                     "frames": frames}
    snap = {"segments": [], "device_traces": [[ev("segment_alloc", 1 << 30, 2 * MiB), ev("alloc", 1 << 30, 512),
                                               ev("free_requested", 1 << 30, 512),
                                               ev("free_completed", 1 << 30, 512)]]}
    if settings:
        snap["allocator_settings"] = {"expandable_segments": False}
    return snap


@pytest.mark.parametrize("frame, settings, expected", [
    ("c10_npu::NPUCachingAllocator::DeviceCachingAllocator::malloc(int, unsigned long, void*)", False, "npu"),
    ("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(int, unsigned long, CUstream_st*)",
     False, "cuda"),
    (None, True, "cuda"),    # CUDA's snapshots carry allocator_settings; torch_npu's do not
    (None, False, None),     # nothing says: unknown (replayed with CUDA's rules unless --device)
])
def test_importer_reads_the_device_type(frame: str | None, settings: bool, expected: str | None) -> None:
    (t,) = snapshot_to_traces(_snapshot(frame, settings), "snap")
    assert t.meta.get("device_type") == expected


def test_importer_reads_torch_npu_python_frames() -> None:
    """A snapshot recorded with Python frames only: a frame in torch_npu's code says NPU."""
    snap = _snapshot("empty_with_format", filename="/venv/site-packages/torch_npu/utils/_tensor.py")
    (t,) = snapshot_to_traces(snap, "snap")
    assert t.meta["device_type"] == "npu"
    (t,) = snapshot_to_traces(_snapshot("train_step", filename="/home/u/train.py"), "snap")
    assert "device_type" not in t.meta


def test_cli_device_option(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "mib.npt"
    _mib_trace().save(path)
    figures = {}
    for device in ("cuda", "npu"):
        out = tmp_path / f"{device}.json"
        assert cli(["replay", str(path), "--policy", "torch", "--no-min-capacity", "--device", device,
                    "--json", str(out)]) == 0
        figures[device] = json.loads(out.read_text())[0]["peak_reserved_bytes"]
    assert figures == {"cuda": 8 * MiB, "npu": 20 * MiB}
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli(["replay", str(path), "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


# ---- the ACL backend pads under torch_npu's condition -------------------------------------------

@pytest.fixture(scope="module")
def fake_acl(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        unavailable("no C compiler to build the fake ACL runtime")
    so = tmp_path_factory.mktemp("acl") / "libfake_acl.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKES / "fake_acl.c"), "-lpthread"], check=True,
                   capture_output=True)
    fake = ctypes.CDLL(str(so))
    fake.fake_set_soc_name.argtypes = fake.fake_set_cann_version.argtypes = [ctypes.c_char_p]
    return str(so), fake


@pytest.mark.parametrize("soc, cann, pads", [
    ("Ascend910B1", "", True),          # every SoC before Ascend950 pads
    ("Ascend910B1", "9.1.0", True),
    ("Ascend950PR", "", True),          # no CANN version known: pads, as torch_npu does
    ("Ascend950PR", "8.5.0", True),
    ("Ascend950PR", "9.0.9", True),
    ("Ascend950PR", "9.1.RC1", True),
    ("Ascend950PR", "9.1.0", False),    # Ascend950 with CANN 9.1.0 or later: no padding
    ("Ascend950DT", "9.2.0", False),
    ("Ascend950PR", "10.0.0", False),
])
def test_acl_backend_pads_as_torch_npu(fake_acl: tuple[str, ctypes.CDLL], soc: str, cann: str, pads: bool) -> None:
    path, fake = fake_acl
    fake.fake_reset()
    fake.fake_set_soc_name(soc.encode())
    fake.fake_set_cann_version(cann.encode())
    with Pool("torch", backend="acl", lib_path=path) as p:
        a = p.malloc(512)
        b = p.malloc(MiB)
        sizes = {x["addr"]: x["size"] for x in p.blocks() if x["allocated"]}
        assert (sizes[a], sizes[b]) == ((1024, MiB + 512) if pads else (512, MiB))
    # whatever the runtime, the npu rules pad and the cuda rules do not
    for rules, expected in (("npu", 1024), ("cuda", 512)):
        with Pool("torch", backend="acl", lib_path=path, rules=rules) as p:
            a = p.malloc(512)
            assert {x["addr"]: x["size"] for x in p.blocks()}[a] == expected


def test_other_commands_take_the_device(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """analyze, export and plan replay under the rules --device names (plan's also takes npu:N)."""
    path = tmp_path / "mib.npt"
    _mib_trace().save(path)
    reports = {}
    for device in ("cuda", "npu"):
        out = tmp_path / f"{device}.json"
        assert cli(["analyze", str(path), "--format", "json", "--policy", "torch", "--no-progress", "--device", device,
                    "-o", str(out)]) == 0
        reports[device] = out.read_text()
        assert cli(["export", str(path), "--policy", "torch", "--device", device, "-o",
                    str(tmp_path / f"{device}.pickle")]) == 0
    assert str(8 * MiB) in reports["cuda"] and str(20 * MiB) in reports["npu"]
    import pickle

    segs = {d: sum(s["total_size"] for s in pickle.loads((tmp_path / f"{d}.pickle").read_bytes())["segments"])
            for d in ("cuda", "npu")}
    assert segs == {"cuda": 8 * MiB, "npu": 20 * MiB}
    for device in ("npu", "npu:0", "cuda", "0"):
        assert cli(["plan", str(path), "--device", device, "--json"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli(["plan", str(path), "--device", "tpu:0"])
    assert "expected npu, cuda, a device index N" in capsys.readouterr().err


def test_a_plan_made_under_npu_rules_serves_the_padded_requests() -> None:
    """torch_npu pads every request before the planned policy sees it: the planner plans the padded
    sizes (and records whose rules), so the plan serves the NPU's requests instead of running online;
    replayed under other rules than its own it is refused, not silently ignored."""
    from npu_pool.capture import capture
    from npu_pool.planner import PlanError, make_plan

    trace = capture(steps=3, progress=False)
    for device in ("npu", "cuda"):
        with forced_device(device):
            plan = make_plan(trace, "capture")
            assert plan.meta["device"] == device
            assert not plan.meta.get("online"), plan.meta.get("online")
            planned, online = run(trace, "planned", plan=plan), run(trace, "npu_pool")
            assert planned.ok and planned.stats["plan"]["served"] > 0, device
            assert planned.peak_reserved_bytes <= online.peak_reserved_bytes, device
    with pytest.raises(PlanError, match="was made with cuda's request rules and would replay under npu's"):
        run(trace, "planned", plan=plan, device="npu")


def test_plan_device_index_takes_ascii_digits_only(capsys: pytest.CaptureFixture) -> None:
    """`plan --device`: a superscript passes str.isdigit but is no index: the usage line names the
    forms taken, not a conversion failure."""
    from npu_pool.commands.plan import _device

    assert _device("npu:1") == ("npu", 1) and _device("2") == (None, 2) and _device("cuda") == ("cuda", None)
    for bad in ("²", "npu:²", "npu:", "tpu"):
        with pytest.raises(SystemExit):
            cli(["plan", "x.npt", "--device", bad])
        err = capsys.readouterr().err
        assert f"{bad!r}: expected npu, cuda, a device index N, or npu:N / cuda:N" in err, err


@pytest.mark.parametrize("policy", ["torch", "npu_pool"])
@pytest.mark.parametrize("rules", ["npu", "cuda"])
def test_the_simulated_device_uses_freed_address_space_again(policy: str, rules: str) -> None:
    """Address space taken and given back over a long run: the simulator's bump pointer ran out of the
    device's window (torch_npu's rules: 20 rounds of 100 TiB on an empty 256 TiB device), and an empty
    device then refused memory, the explanation blaming memory held outside (a review, a helper)."""
    TiB = 1 << 40
    with Pool(policy, capacity=256 * TiB, rules=rules) as p:
        for _ in range(40):
            p.free(p.malloc(100 * TiB))
            p.empty_cache()
        assert p.stats()["total"]["reserved"]["current"] == 0
        p.check()
