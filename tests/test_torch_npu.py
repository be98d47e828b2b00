"""npu_pool inside the real torch_npu 2.13.0, started over a fake CANN runtime (tests/fake_vendor:
device memory is host memory, copies are memmove, no kernel runs). Each test runs a script in
the torch_npu venv (`./run test` makes it; torch_npu hooks itself into every `import torch`, so
it stays out of this process) and asserts on the values the script reports."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from conftest import TorchNpu

MiB = 1 << 20
CAPACITY = 1 << 30  # the fake device (FAKE_CAPACITY's default)

# Shared by the scripts: the fake runtime's own counters, to check the pool's books against.
FAKE = """
import ctypes, json
fake = ctypes.CDLL("libascendcl.so")
fake.fake_used.restype = fake.fake_mapped.restype = ctypes.c_ulonglong
"""


def test_env_switch_installs_the_pool_and_torch_memory_apis_report_it(torch_npu: TorchNpu) -> None:
    out, err = torch_npu.results(FAKE + """
import mindspeed_patch                      # MEMORY_FRAGMENTATION=1: installs npu_pool
import torch, torch_npu
from npu_pool.install import installed
from npu_pool.torch_memory import stats_dict
pools = installed()
r = {"devices": sorted(pools), "hooks": sorted(__import__("npu_pool.install").install._current.hooks)}
sizes = [1, 7, 511, 512, 4096, 100_000, 3 << 20, (5 << 20) + 3]
host = [torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8) for n in sizes]
dev = [h.to("npu") for h in host]
r["roundtrip"] = [bool(torch.equal(d.cpu(), h)) for h, d in zip(host, dev)]
clone = dev[6].clone()                       # device-to-device copy
r["d2d"] = bool(torch.equal(clone.cpu(), host[6]))
r["data_ptrs_distinct"] = len({d.data_ptr() for d in dev} | {clone.data_ptr()}) == len(dev) + 1
p = pools[0]
st = p.stats()
r["pairs"] = {
    "allocated": [torch.npu.memory_allocated(), st["total"]["allocated"]["current"]],
    "max_allocated": [torch.npu.max_memory_allocated(), st["total"]["allocated"]["peak"]],
    "reserved": [torch.npu.memory_reserved(), st["total"]["reserved"]["current"]],
    "max_reserved": [torch.npu.max_memory_reserved(), st["total"]["reserved"]["peak"]],
    "device_used": [fake.fake_used(), st["total"]["reserved"]["current"]],
}
r["stats_from_cpp_equal_python_mapping"] = torch.npu.memory_stats_as_nested_dict() == stats_dict(p)
r["num_device_alloc"] = [torch.npu.memory_stats()["num_device_alloc"], st["device_mallocs"]]
del dev[6]                                   # freed among live tensors: memory empty_cache cannot return
r["non_releasable"] = [torch.npu.memory_stats()["inactive_split_bytes.all.current"], p.stats()["non_releasable"]]
r["stats_from_cpp_equal_after_a_free"] = torch.npu.memory_stats_as_nested_dict() == stats_dict(p)
summary = torch.npu.memory_summary()
r["summary_has_figures"] = "Allocated memory" in summary and "NPU reserved memory" in summary
free_b, total_b = torch.npu.mem_get_info()
r["mem_get_info"] = [free_b, total_b, fake.fake_used()]
before = p.stats()["total"]["allocated"]["current"]
del dev, clone
r["freed"] = [before, torch.npu.memory_allocated(), p.stats()["frees"]]
torch.npu.empty_cache()
r["after_empty_cache"] = [torch.npu.memory_reserved(), fake.fake_mapped(), p.stats()["total"]["reserved"]["current"]]
torch.npu.reset_peak_memory_stats()
r["peak_reset"] = [torch.npu.max_memory_allocated(), torch.npu.memory_allocated()]
torch.npu.reset_accumulated_memory_stats()
r["accumulated_reset"] = torch.npu.memory_stats()["allocated_bytes.all.allocated"]
# a second device, and a side stream whose use of a block is recorded
torch.npu.set_device(1)
x = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
r["device1"] = [x.device.index, torch.npu.memory_allocated(1), pools[1].stats()["total"]["allocated"]["current"]]
side = torch.npu.Stream()
x.record_stream(side)
waits = pools[1].stats()["stream_waits"]
del x
r["recorded_block_tagged"] = any(b["tagged"] and not b["allocated"] for b in pools[1].blocks())
y = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
r["reuse_waited"] = pools[1].stats()["stream_waits"] - waits
# the fraction cap
torch.npu.set_device(0)
torch.npu.set_per_process_memory_fraction(0.25, 0)
r["limit"] = p.stats()["limit"]
r["fraction_read_back"] = torch.npu.get_per_process_memory_fraction(0)
observed = []
torch_npu._C._npu_attach_out_of_memory_observer(lambda *a: observed.append(list(a)))
try:
    torch.empty(300 << 20, dtype=torch.uint8, device="npu")
    r["capped"] = "no error"
except torch.OutOfMemoryError as e:
    r["capped"] = str(e)
r["observed"] = observed
r["refused_fractions"] = []                  # raised, not printed: the cap stays what it was
for f, d in ((float("nan"), 0), (0.0, 0), (0.5, 7)):
    try:
        torch.npu.set_per_process_memory_fraction(f, d)
        r["refused_fractions"].append("accepted")
    except Exception as e:
        r["refused_fractions"].append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
r["limit_after_refusals"] = p.stats()["limit"]
try:
    torch.empty(1 << 62, dtype=torch.uint8, device="npu")
    r["absurd"] = "no error"
except torch.OutOfMemoryError as e:
    r["absurd"] = "OutOfMemoryError: " + str(e).splitlines()[0]
except Exception as e:
    r["absurd"] = type(e).__name__
# the older form (MindSpeed's --record-memory-history): torch_npu's Python wrapper raised TypeError
torch.npu.memory._record_memory_history(True, trace_alloc_max_entries=3, trace_alloc_record_context=True)
kept = [torch.empty(n << 20, dtype=torch.uint8, device="npu") for n in (1, 2, 3, 4)]
r["legacy_history"] = len(p.history())
print(json.dumps(r))
""", MEMORY_FRAGMENTATION="1")
    assert out["devices"] == [0, 1]
    assert out["hooks"] == ["set_erase_stream_fn", "set_get_device_stats_fn", "set_init_fn", "set_memory_fraction_fn",
                            "set_record_stream_fn", "set_reset_fn", "set_reset_peak_status_fn"]
    assert all(out["roundtrip"]) and out["d2d"] and out["data_ptrs_distinct"]
    for name, (torch_says, pool_says) in out["pairs"].items():
        assert torch_says == pool_says, name
    assert out["pairs"]["allocated"][0] > 8 * MiB
    assert out["legacy_history"] == 3  # the bound the older form asked for
    assert out["stats_from_cpp_equal_python_mapping"]
    assert out["num_device_alloc"][0] == out["num_device_alloc"][1] > 0
    torch_says, pool_says = out["non_releasable"]  # (the C++ hook reads the core's figure, as the mapping does)
    assert torch_says == pool_says >= 3 * MiB and out["stats_from_cpp_equal_after_a_free"]
    assert out["summary_has_figures"]
    free_b, total_b, used = out["mem_get_info"]
    assert total_b == CAPACITY and free_b == CAPACITY - used
    before, after, frees = out["freed"]
    assert after < before and frees >= 9
    reserved, mapped, pool_reserved = out["after_empty_cache"]
    assert reserved == mapped == pool_reserved < out["pairs"]["reserved"][0]
    assert out["peak_reset"][0] == out["peak_reset"][1]
    assert out["accumulated_reset"] == 0
    index, torch_says, pool_says = out["device1"]
    assert index == 1 and torch_says == pool_says >= MiB
    assert out["recorded_block_tagged"] and out["reuse_waited"] == 1
    assert out["limit"] == CAPACITY // 4 and out["fraction_read_back"] == 0.25
    (device, request, cap, device_free), = out["observed"]  # torch's out-of-memory observer, called once
    assert (device, cap) == (0, CAPACITY // 4) and 300 << 20 <= request <= (300 << 20) + 64 and device_free >= 0
    assert "out of memory on device 0 (policy npu_pool)" in out["capped"] and "256.00 MiB cap" in out["capped"]
    nan, zero, device7 = out["refused_fractions"]
    assert nan.startswith("RuntimeError: npu_pool: memory fraction must be in (0, 1], got nan"), nan
    assert zero.startswith("RuntimeError: npu_pool: memory fraction must be in (0, 1], got 0"), zero
    assert device7.startswith("RuntimeError: npu_pool: device 7 is out of range (0..1)"), device7
    assert out["limit_after_refusals"] == CAPACITY // 4
    assert out["absurd"].startswith("OutOfMemoryError: npu_pool: malloc of 4611686018427387904 bytes"), out["absurd"]
    assert "Traceback" not in err


def test_out_of_memory_is_one_clear_error_with_the_pools_explanation(torch_npu: TorchNpu) -> None:
    """npu_pool.install() called by hand; a request that cannot be served raises torch's
    OutOfMemoryError once, with the pool's explanation (here, the torch model's fragmentation in
    its large pool), and nothing else is printed about it."""
    out, err = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
npu_pool.install(policy="torch", fraction=0.125)   # 128 MiB of the fake's 1 GiB
keep = [torch.empty(3 << 20, dtype=torch.uint8, device="npu") for _ in range(36)]  # 6 segments of 20 MiB
del keep[::2]                                      # 54 MiB free, in 3 MiB holes of segments still in use
r = {}
try:
    torch.empty(12 << 20, dtype=torch.uint8, device="npu")
except Exception as e:
    r["type"], r["message"] = type(e).__name__, str(e)
r["ooms"] = torch.npu.memory_stats()["num_ooms"]
r["ok_after"] = torch.empty(3 << 20, dtype=torch.uint8, device="npu").numel()
print(json.dumps(r))
""")
    assert out["type"] == "OutOfMemoryError"
    msg = out["message"]
    assert "out of memory on device 0 (policy torch): tried to allocate 12.00 MiB" in msg
    assert "fragmentation" in msg and "large" in msg
    assert "Get data_ptr failed" not in msg
    assert "out of memory" not in err and "npu_pool: malloc failed" not in err  # said once: in the error
    assert out["ooms"] == 1 and out["ok_after"] == 3 * MiB


def test_a_pool_without_the_virtual_memory_api_says_it_takes_its_whole_cap(torch_npu: TorchNpu) -> None:
    """Where the runtime has no virtual-memory API (or its probe fails), npu_pool's memory is one
    allocation of the whole cap at the first tensor: it took 896 MiB for 1 MiB and said nothing,
    so a user met it as a collective's out-of-memory (a review, 2026-11-27). One line on stderr
    says it, with the probe's reason and the lever; a pool with the API says nothing."""
    for vmm in (0, 1):
        out, err = torch_npu.results(FAKE + f"""
fake.fake_set_vmm({vmm})
import torch, torch_npu, npu_pool
x = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
print(json.dumps({{"vmm": npu_pool.install.installed()[0].stats()["vmm"], "reserved": torch.npu.memory_reserved()}}))
""", MEMORY_FRAGMENTATION="1")
        said = [line for line in err.splitlines() if line.startswith("npu_pool:")]
        assert out["vmm"] == bool(vmm)
        if vmm:
            assert said == [] and out["reserved"] < 32 * MiB
        else:
            assert out["reserved"] > 512 * MiB and len(said) == 1, err
            assert "device 0: acl (no VMM: the probe aclrtReserveMemAddress failed" in said[0]
            assert "one allocation of the whole cap (1.00 GiB" in said[0] and "NPU_POOL_FRACTION" in said[0]


def test_a_device_pool_that_cannot_be_made_names_the_settings_that_configured_it(torch_npu: TorchNpu,
                                                                                  tmp_path: Path) -> None:
    """A setting that only the device can refuse is refused at the first tensor (import torch
    cannot ask the device): NPU_POOL_POLICY=expandable on a runtime without the virtual-memory API,
    a fraction of the device smaller than a block. The error named neither variable (a review of
    the switch, 2026-11-28); it now says what configured the pool. Set through install(), nothing
    is named."""
    config = tmp_path / "names.yaml"
    config.write_text("npu_pool_policy: expandable\n")
    for env, vmm, cap, words, never in (
            (dict(NPU_POOL_POLICY="expandable"), 0, None, "configured by NPU_POOL_POLICY='expandable')", None),
            (dict(NPU_POOL_FRACTION="1e-9"), 1, None, "configured by NPU_POOL_FRACTION='1e-9')", None),
            (dict(NPU_POOL_CONFIG=str(config)), 0, None, f"configured by npu_pool_policy='expandable' (in {config}))",
             None),
            # the cap torch set since is what fails: the variable's is not named
            (dict(NPU_POOL_FRACTION="0.5"), 1, 1e-9, "memory fraction 1e-09", "NPU_POOL_FRACTION")):
        out, err = torch_npu.results(FAKE + f"""
fake.fake_set_vmm({vmm})
import torch, torch_npu
if {cap!r} is not None:
    torch.npu.set_per_process_memory_fraction({cap!r}, 0)
try:
    torch.empty(1 << 20, dtype=torch.uint8, device="npu")
    print(json.dumps({{"error": None}}))
except RuntimeError as e:
    print(json.dumps({{"error": str(e)}}))
""", MEMORY_FRAGMENTATION="1", **env)
        assert out["error"] and words in out["error"], (out, err[-1000:])
        assert never is None or never not in out["error"], out
    out, err = torch_npu.results(FAKE + """
fake.fake_set_vmm(0)
import torch, torch_npu, npu_pool
npu_pool.install(policy="expandable")
try:
    torch.empty(1 << 20, dtype=torch.uint8, device="npu")
    print(json.dumps({"error": None}))
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
""")
    assert "needs a backend with a virtual-memory API" in out["error"] and "configured by" not in out["error"]


def test_pause_waits_for_work_still_in_torch_npus_task_queue(torch_npu: TorchNpu) -> None:
    """torch_npu queues an op's work on its task queue, launched on the device by its own thread:
    pause synchronised with aclrtSynchronizeDevice, which does not wait for work still queued, so
    copies queued into a tag's tensors ran after its memory was unmapped (a segmentation fault in
    the first or second cycle, 3 runs of 3: a review, 2026-11-27). The pool's device
    synchronisations go through torch_npu's npuSynchronizeDevice (the C++ hooks), queue first."""
    out, err = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
npu_pool.install()
with npu_pool.region("train"):
    W = [torch.zeros(16 << 20, dtype=torch.uint8).to("npu") for _ in range(8)]
H = [torch.full((16 << 20,), 7, dtype=torch.uint8).pin_memory() for _ in range(8)]
kept = []
for cycle in range(4):
    for w, h in zip(W, H):
        w.copy_(h, non_blocking=True)   # still queued when pause starts
    npu_pool.pause("train", backup=True)
    npu_pool.resume("train")
    kept.append(all(bool(torch.equal(w.cpu(), h)) for w, h in zip(W, H)))
    for w in W:
        w.copy_(torch.zeros(16 << 20, dtype=torch.uint8))
print(json.dumps({"kept": kept}))
""")
    assert out["kept"] == [True] * 4, err[-3000:]


def test_compact_returns_what_empty_cache_cannot(torch_npu: TorchNpu) -> None:
    """npu_pool.compact() inside torch_npu: tensors freed among live ones keep their chunks mapped
    through torch.npu.empty_cache(); compact() gives those pages back (memory_reserved drops by
    what it returns, the fake device's used bytes with it) and the live tensors keep their bytes
    and addresses. (Its synchronisation is pause's, through torch_npu's task queue first:
    test_pause_waits_for_work_still_in_torch_npus_queue guards it; copies queued here are drained
    by the empty_cache before it.)"""
    out, err = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
npu_pool.install()
H = [torch.full((25 << 20,), i, dtype=torch.uint8).pin_memory() for i in range(10)]
T = [torch.empty(25 << 20, dtype=torch.uint8, device="npu") for _ in range(10)]
live = list(range(1, 10, 2))
for i in live:
    T[i].copy_(H[i], non_blocking=True)
ptrs = [T[i].data_ptr() for i in live]
for i in range(0, 10, 2):
    T[i] = None
torch.npu.empty_cache()
r = {"before": torch.npu.memory_reserved()}
r["returned"] = npu_pool.compact()
r["after"], r["device_used"] = torch.npu.memory_reserved(), fake.fake_used()
r["kept"] = [bool(torch.equal(T[i].cpu(), H[i])) for i in live]
r["same_addresses"] = [T[i].data_ptr() for i in live] == ptrs
r["allocated"] = torch.npu.memory_allocated()
pool, g = npu_pool.installed()[0], 2 << 20
r["compactions"] = pool.stats()["compactions"]
r["touched"] = g * len({q for x in ptrs for q in range(x // g, (x + pool.block_size(x) - 1) // g + 1)})
print(json.dumps(r))
""")
    assert out["kept"] == [True] * 5 and out["same_addresses"], err[-3000:]
    assert out["returned"] > 0 and out["after"] == out["before"] - out["returned"] == out["device_used"]
    assert out["compactions"] > 0 and out["after"] == out["touched"]  # the live tensors' pages, no more


HANDOVERS = FAKE + """
import os
import torch, torch_npu, npu_pool
from npu_pool.install import installed
npu_pool.install()
names = ["aclrtSynchronizeDevice", "aclrtRecordEvent", "aclrtStreamWaitEvent", "aclrtCreateEventExWithFlag"]
src = torch.full((4 << 20,), 3, dtype=torch.uint8).to("npu")
p, side = installed()[0], torch.npu.Stream()
torch.npu.synchronize()
before, st = {n: fake.fake_calls(n.encode()) for n in names}, p.stats()
if os.environ.get("FAIL_ONCE"):             # a runtime call that fails once, the first time
    fake.fake_fail(os.environ["FAIL_ONCE"].encode(), 0, 1, 107000)
kept = []
for i in range(6):
    x = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
    with torch.npu.stream(side):
        x.copy_(src)                        # queued on the side stream
    x.record_stream(side)
    del x                                   # its memory, reused by the current stream: a handover
    y = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
    y.copy_(src)
    kept.append(bool(torch.equal(y.cpu(), src.cpu())))
    del y
r = {"fake": {n: fake.fake_calls(n.encode()) - before[n] for n in names}, "kept": kept,
     "handovers": p.stats()["stream_waits"] - st["stream_waits"],
     "pool": {k: v - st["calls"][k] for k, v in p.stats()["calls"].items() if v != st["calls"][k]}}
print(json.dumps(r))
"""


def test_a_handover_between_streams_is_an_event_through_torch_npus_queue(torch_npu: TorchNpu) -> None:
    """A block recorded on a side stream and reused by the current one is ordered on the device by
    an NPUEvent recorded and waited through torch_npu's task queue (the C++ hooks), not by a device
    synchronisation (one per handover before: 235 where torch_npu's allocator made 39 on
    llama7b-offload-infer, docs/live.md). One event, made once, re-recorded for each handover."""
    out, err = torch_npu.results(HANDOVERS)
    assert out["kept"] == [True] * 6 and out["handovers"] == 6, err[-3000:]
    assert out["fake"] == {"aclrtSynchronizeDevice": 0, "aclrtRecordEvent": 6, "aclrtStreamWaitEvent": 6,
                           "aclrtCreateEventExWithFlag": 1}
    assert out["pool"] == {"event_create": 1, "event_record": 6, "event_wait": 6}


def test_a_handover_under_per_stream_queues_is_a_synchronisation(torch_npu: TorchNpu) -> None:
    """With torch_npu's PER_STREAM_QUEUE a re-recorded event's record could be launched after a
    later one on another queue: the hooks share no event there and the handover synchronises --
    but only where torch_npu has per-stream queues: not with its task queue off (TASK_QUEUE_ENABLE=0)
    or launches blocking (ASCEND_LAUNCH_BLOCKING=1), where it ignores the setting (a review)."""
    out, err = torch_npu.results(HANDOVERS, PER_STREAM_QUEUE="1")
    assert out["kept"] == [True] * 6 and out["handovers"] == 6, err[-3000:]
    assert out["fake"] == {"aclrtSynchronizeDevice": 6, "aclrtRecordEvent": 0, "aclrtStreamWaitEvent": 0,
                           "aclrtCreateEventExWithFlag": 0}
    assert out["pool"] == {"sync_device": 6}
    for off in ({"TASK_QUEUE_ENABLE": "0"}, {"ASCEND_LAUNCH_BLOCKING": "1"}):
        out, err = torch_npu.results(HANDOVERS, PER_STREAM_QUEUE="1", **off)
        assert out["kept"] == [True] * 6 and out["pool"] == {"event_create": 1, "event_record": 6, "event_wait": 6}, \
            (off, err[-3000:])


def test_a_handover_to_an_external_stream_synchronises_and_counts_what_it_called(torch_npu: TorchNpu) -> None:
    """torch_npu refuses events on an external stream (torch.npu.ExternalStream): the hooks kept it
    as a current stream, recorded the event on the other stream, then the wait threw and the pool
    synchronised, every time, uncounting the event it made and the records (a review of the
    handovers, a helper). Now the first handover's record is counted, the stream is refused from
    then on, and every handover to it is a synchronisation only."""
    out, err = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
from npu_pool.install import installed
npu_pool.install()
names = {"sync_device": "aclrtSynchronizeDevice", "event_record": "aclrtRecordEvent",
         "event_wait": "aclrtStreamWaitEvent", "event_create": "aclrtCreateEventExWithFlag"}
side = torch.npu.Stream()                   # (torch_npu starts the device: a stream can be made)
torch.npu.synchronize()
raw = ctypes.c_void_p()
assert fake.aclrtCreateStream(ctypes.byref(raw)) == 0
ext = torch.npu.ExternalStream(raw.value, device=torch.device("npu:0"))
p = installed()[0]
before, st = {k: fake.fake_calls(n.encode()) for k, n in names.items()}, p.stats()
with torch.npu.stream(ext):                 # the external stream is current
    for i in range(3):
        x = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
        x.record_stream(side)
        del x                               # used on side, reused on ext: a handover
        y = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
        del y
r = {"fake": {k: fake.fake_calls(n.encode()) - before[k] for k, n in names.items()},
     "handovers": p.stats()["stream_waits"] - st["stream_waits"],
     "pool": {k: p.stats()["calls"][k] - st["calls"][k] for k in names}}
print(json.dumps(r))
""")
    assert out["handovers"] == 3, err[-3000:]
    assert out["fake"] == out["pool"] == {"sync_device": 3, "event_record": 1, "event_wait": 0, "event_create": 1}


def test_a_handover_call_that_fails_once_is_counted_and_the_stream_kept(torch_npu: TorchNpu) -> None:
    """A runtime call of a handover that fails (launched straight, TASK_QUEUE_ENABLE=0) made the
    hooks refuse the stream for good (every later handover a synchronisation) and left the calls
    made before it uncounted (a review of the diff). Now that handover synchronises, its calls are
    counted as the runtime counts them, and the next ones are events again."""
    for call, want in (("aclrtRecordEvent", {"aclrtSynchronizeDevice": 1, "aclrtRecordEvent": 6,
                                             "aclrtStreamWaitEvent": 5, "aclrtCreateEventExWithFlag": 1}),
                       ("aclrtStreamWaitEvent", {"aclrtSynchronizeDevice": 1, "aclrtRecordEvent": 6,
                                                 "aclrtStreamWaitEvent": 6, "aclrtCreateEventExWithFlag": 1})):
        out, err = torch_npu.results(HANDOVERS, TASK_QUEUE_ENABLE="0", FAIL_ONCE=call)
        assert out["handovers"] == 6 and out["fake"] == want, (call, out, err[-3000:])
        kinds = {"aclrtSynchronizeDevice": "sync_device", "aclrtRecordEvent": "event_record",
                 "aclrtStreamWaitEvent": "event_wait", "aclrtCreateEventExWithFlag": "event_create"}
        assert out["pool"] == {kinds[k]: v for k, v in want.items()}, call


def test_a_stream_first_seen_in_a_raw_allocation_is_known_once_current(torch_npu: TorchNpu) -> None:
    """A raw allocation on a stream that is not current (caching_allocator_alloc with a stream)
    left the stream marked as seen though not kept, so its allocations once it was current were
    never kept either and every handover to it synchronised (a review of the diff)."""
    out, err = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
from npu_pool.install import installed
npu_pool.install()
names = {"sync_device": "aclrtSynchronizeDevice", "event_record": "aclrtRecordEvent"}
side = torch.npu.Stream()
torch.npu.synchronize()
p = installed()[0]
before = {k: fake.fake_calls(n.encode()) for k, n in names.items()}
x = torch.empty(4 << 20, dtype=torch.uint8, device="npu")   # on the current stream
ptr = torch.npu.caching_allocator_alloc(1 << 20, 0, side)   # on side, while side is not current
del x
with torch.npu.stream(side):                                 # side current: its 4 MiB reuse x's memory
    y = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
torch.npu.caching_allocator_delete(ptr)
print(json.dumps({k: fake.fake_calls(n.encode()) - before[k] for k, n in names.items()}
                 | {"handovers": p.stats()["stream_waits"]}))
""")
    assert out == {"sync_device": 0, "event_record": 1, "handovers": 1}, err[-3000:]


def test_handovers_from_four_threads_share_the_devices_event(torch_npu: TorchNpu) -> None:
    """Four threads, each on its own stream with its own side stream, hand memory over 40 times
    each: every handover is ordered by the one event through the queue (a wait per stream behind
    mixed memory) and the pool's count of each call is the runtime's. (The fake runtime runs work
    as it is queued: the data checks cannot show a misordered handover, only a lost one.)"""
    out, err = torch_npu.results(FAKE + """
import threading
import torch, torch_npu, npu_pool
from npu_pool.install import installed
npu_pool.install()
names = ["aclrtSynchronizeDevice", "aclrtRecordEvent", "aclrtStreamWaitEvent", "aclrtCreateEventExWithFlag"]
src = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8).to("npu")
p = installed()[0]
torch.npu.synchronize()
before, st = {n: fake.fake_calls(n.encode()) for n in names}, p.stats()
errors, kept = [], []
def work(k):
    try:
        torch.npu.set_device(0)
        mine, side = torch.npu.Stream(), torch.npu.Stream()
        with torch.npu.stream(mine):
            for i in range(40):
                x = torch.empty((1 + k) << 20, dtype=torch.uint8, device="npu")
                with torch.npu.stream(side):
                    x[: 1 << 20].copy_(src)
                x.record_stream(side)
                del x
                y = torch.empty((1 + k) << 20, dtype=torch.uint8, device="npu")
                y[: 1 << 20].copy_(src)
                kept.append(bool(torch.equal(y[: 1 << 20].cpu(), src.cpu())))
                del y
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
torch.npu.synchronize()
r = {"fake": {n: fake.fake_calls(n.encode()) - before[n] for n in names}, "errors": errors, "kept": kept,
     "handovers": p.stats()["stream_waits"] - st["stream_waits"],
     "pool": {k: v - st["calls"][k] for k, v in p.stats()["calls"].items() if v != st["calls"][k]}}
print(json.dumps(r))
""")
    # (how many reuses hand over depends on how the threads interleave: about one per iteration)
    assert out["errors"] == [] and out["kept"] == [True] * 160 and out["handovers"] >= 80, err[-3000:]
    fake, pool = out["fake"], out["pool"]
    assert fake["aclrtSynchronizeDevice"] == 1  # the script's own, at its end
    assert fake["aclrtCreateEventExWithFlag"] == pool["event_create"] == 1
    assert fake["aclrtRecordEvent"] == fake["aclrtStreamWaitEvent"] == pool["event_record"] == pool["event_wait"]
    assert pool["event_record"] >= out["handovers"] and "sync_device" not in pool


def test_a_second_allocator_swap_names_npu_pool(torch_npu: TorchNpu) -> None:
    """MindSpeed's --smart-swap swaps in its own allocator (torch_npu.npu.memory.change_current_allocator):
    with npu_pool installed torch_npu refused with a traceback naming neither ("Can't swap an already
    initialized allocator"); the refusal names npu_pool and what to unset, and the pool keeps serving."""
    out, err = torch_npu.results("""
import json, torch, torch_npu
import npu_pool
from npu_pool.torch_memory import AllocatorInUseError
npu_pool.install()
x = torch.empty(1 << 20, device="npu")
try:
    other = torch_npu.npu.memory.NPUPluggableAllocator("libc.so.6", "malloc", "free")
    torch_npu.npu.memory.change_current_allocator(other)
    r = {"raised": None}
except AllocatorInUseError as e:
    r = {"raised": str(e)}
y = torch.empty(1 << 20, device="npu")
r["served"] = npu_pool.installed()[0].stats()["total"]["allocated"]["current"] >= 2 << 20
print(json.dumps(r))
""")
    assert out["raised"] and "npu_pool is torch's NPU allocator" in out["raised"], err[-2000:]
    assert "unset MEMORY_FRAGMENTATION" in out["raised"] and out["served"]


def test_install_after_torch_npus_own_allocator_served_is_too_late(torch_npu: TorchNpu) -> None:
    out, _ = torch_npu.results("""
import json, torch, torch_npu
early = torch.empty(16, device="npu")          # torch_npu's own caching allocator serves this
import npu_pool
from npu_pool.install import TooLateError, installed
try:
    npu_pool.install()
    r = {"raised": None}
except TooLateError as e:
    r = {"raised": str(e)}
r["installed"] = installed()
print(json.dumps(r))
""")
    assert out["raised"] and "came too late" in out["raised"] and "Set MEMORY_FRAGMENTATION=1" in out["raised"]
    assert out["installed"] == {}


def test_a_process_that_never_used_the_device_is_left_without_one(torch_npu: TorchNpu, tmp_path: Path) -> None:
    """With reports asked, a process that imported torch with the switch on and never used the
    NPU (a launcher, the parent of spawned ranks, a DataLoader worker) started torch_npu's runtime
    at exit to look up the current device for its report, then wrote an empty report under rank
    0's name. It now starts nothing and writes nothing."""
    rep = tmp_path / "rep"
    out, _ = torch_npu.results(f"""
import atexit, json, os
def after_everything():                      # (registered first: runs after the patch's own exit handler)
    import torch
    print(json.dumps({{"initialized": torch.npu.is_initialized(), "reports": sorted(os.listdir({str(rep)!r}))
                      if os.path.isdir({str(rep)!r}) else []}}))
atexit.register(after_everything)
import mindspeed_patch, torch, torch_npu
from npu_pool.install import current_pool, installed
assert installed() and current_pool(start=False) is None
""", MEMORY_FRAGMENTATION="1", NPU_POOL_REPORT_DIR=str(rep))
    assert out == {"initialized": False, "reports": []}


def test_memory_history_snapshots_and_oom_snapshots(torch_npu: TorchNpu, tmp_path: Path) -> None:
    """torch.npu.memory._record_memory_history / _snapshot / _dump_snapshot work with the pool
    installed (MindSpeed-MM's memory profiler uses them), and OOM_SNAPSHOT_ENABLE/OOM_SNAPSHOT_PATH
    write a snapshot when a request fails."""
    dump, oom_dir = tmp_path / "dump.pickle", tmp_path / "oom"
    oom_dir.mkdir()  # torch_npu insists that OOM_SNAPSHOT_PATH exists
    out, _ = torch_npu.results(FAKE + f"""
import mindspeed_patch, torch, torch_npu
from npu_pool.install import installed
torch.npu.memory._record_memory_history(max_entries=10000)
a = torch.empty(3 << 20, dtype=torch.uint8, device="npu")
b = torch.empty(1000, dtype=torch.uint8, device="npu")
addr_a = a.data_ptr()
del a
torch.npu.memory._dump_snapshot({str(dump)!r})
segments = torch.npu.memory_snapshot()
r = {{"addr_a": addr_a, "addr_b": b.data_ptr(), "segments": len(segments),
     "reserved": installed()[0].stats()["total"]["reserved"]["current"]}}
torch.npu.set_per_process_memory_fraction(0.05, 0)
try:
    torch.empty(200 << 20, dtype=torch.uint8, device="npu")
except torch.OutOfMemoryError as e:
    r["oom"] = str(e)
print(json.dumps(r))
""", MEMORY_FRAGMENTATION="1", OOM_SNAPSHOT_ENABLE="1", OOM_SNAPSHOT_PATH=str(oom_dir))
    with open(dump, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert [e["addr"] for e in allocs[-2:]] == [out["addr_a"], out["addr_b"]]
    assert allocs[-2]["size"] == 3 * MiB and allocs[-1]["size"] == 1000
    assert [e["action"] for e in trace[-2:]] == ["free_requested", "free_completed"]
    assert trace[-1]["addr"] == out["addr_a"]
    assert any(e["action"] == "segment_map" for e in trace)
    assert sum(s["total_size"] for s in snap["segments"]) == out["reserved"] and out["segments"] == len(snap["segments"])
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [b["requested_size"] for b in live] == [1000]
    from npu_pool.trace.snapshot import load_snapshot

    (t,) = load_snapshot(dump)  # the project's importer reads it as any PyTorch snapshot
    assert len(t) >= 3
    (oom_pickle,) = oom_dir.glob("oom_snapshot_*.pickle")
    assert str(oom_pickle) in out["oom"] and "memory_viz" in out["oom"]
    with open(oom_pickle, "rb") as f:
        oom_snap = pickle.load(f)
    assert oom_snap["device_traces"][0][-1]["action"] == "oom" and oom_snap["device_traces"][0][-1]["size"] == 200 * MiB


def test_kernels_fail_loudly_on_the_fake_runtime(torch_npu: TorchNpu) -> None:
    """No operator runs on the fake runtime: a kernel is an error naming it, never silent success.
    torch_npu launches operators from its task queue, as a device runs them asynchronously: the
    failure surfaces at the next synchronisation (without one, a script that ends first exits 0)."""
    r = torch_npu.run("""
import mindspeed_patch, torch, torch_npu
x = torch.empty(3, device="npu")
torch.ones(3, device="npu")
torch.npu.synchronize()
print("NOT REACHED")
""", MEMORY_FRAGMENTATION="1")
    assert r.returncode != 0 and "NOT REACHED" not in r.stdout
    assert "fake CANN: aclopCompileAndExecute (operator OnesLike) cannot run" in r.stderr
    assert "RuntimeError" in r.stderr


def test_without_a_cxx_compiler_the_c_hooks_serve_and_python_answers_the_statistics(torch_npu: TorchNpu,
                                                                                    tmp_path: Path) -> None:
    out, err = torch_npu.results(FAKE + """
import warnings
warnings.simplefilter("always")
import mindspeed_patch, torch, torch_npu
from npu_pool.install import installed
x = torch.empty(5 << 20, dtype=torch.uint8, device="npu")
p = installed()[0]
r = {"allocated": [torch.npu.memory_allocated(), p.stats()["total"]["allocated"]["current"]],
     "stats": torch.npu.memory_stats()["allocated_bytes.all.current"]}
torch.npu.set_per_process_memory_fraction(0.05, 0)
try:
    torch.empty(200 << 20, dtype=torch.uint8, device="npu")
except RuntimeError as e:
    r["oom"] = str(e)
print(json.dumps(r))
""", MEMORY_FRAGMENTATION="1", CXX="/nonexistent/g++", NPU_POOL_CACHE=str(tmp_path))
    assert "using the C hooks only" in err and "/nonexistent/g++" not in out.get("oom", "")
    assert "Tensor.record_stream() does nothing" in err  # (it was dropped without a word)
    assert out["allocated"][0] == out["allocated"][1] == out["stats"] >= 5 * MiB
    assert "Get data_ptr failed" in out["oom"]  # what torch_npu says when a C hook returns NULL ...
    assert err.count("out of memory on device 0") == 1  # ... after the pool's explanation, printed once


def test_graph_capture_and_private_pools_are_refused(torch_npu: TorchNpu) -> None:
    """torch_npu's NPUPluggableAllocator does nothing on beginAllocateToPool (no hook is set, and
    torch_npu has no Python setter for one): an NPU graph captured under npu_pool would have its
    memory handed to other tensors while it replays. Capture (the graph class, its C base class,
    the context manager), use_mem_pool and the pool entry points raise npu_pool's error instead
    (here before the fake CANN's missing capture functions could)."""
    out, _ = torch_npu.results(FAKE + """
import torch, torch_npu, npu_pool
npu_pool.install()
x = torch.empty(4 << 20, dtype=torch.uint8, device="npu")
r = {}
def attempt(name, call):
    try:
        call()
        r[name] = "ran"
    except Exception as e:
        r[name] = type(e).__name__ + ": " + str(e)
attempt("graph", lambda: torch.npu.graph(torch.npu.NPUGraph()).__enter__())
attempt("capture_begin", lambda: torch.npu.NPUGraph().capture_begin())
attempt("base_capture_begin", lambda: torch_npu._C._NPUGraph().capture_begin(pool=(0, 0), capture_error_mode="global"))
attempt("super_capture_begin", lambda: super(torch.npu.NPUGraph, torch.npu.NPUGraph()).capture_begin(pool=(0, 0)))
attempt("use_mem_pool", lambda: torch.npu.use_mem_pool(type("P", (), {"id": (7, 0)})(), device=0).__enter__())
for name in ("_npu_beginAllocateToPool", "_npu_beginAllocateCurrentStreamToPool", "_npu_beginAllocateCurrentThreadToPool"):
    attempt(name, lambda: getattr(torch_npu._C, name)(0, (7, 0)))
attempt("end", lambda: torch_npu._C._npu_endAllocateToPool(0, (7, 0)))
r["stream"] = torch.npu.current_stream() == torch.npu.default_stream()
r["after"] = torch.empty(1 << 20, dtype=torch.uint8, device="npu").numel()
print(json.dumps(r))
""")
    refused = ("PrivatePoolError: npu_pool: graph capture and private memory pools (torch.npu.graph, "
               "NPUGraph.capture_begin, torchair's aclgraph mode, MemPool) are not supported while npu_pool is torch's "
               "allocator")
    for name in ("graph", "capture_begin", "base_capture_begin", "super_capture_begin", "use_mem_pool",
                 "_npu_beginAllocateToPool", "_npu_beginAllocateCurrentStreamToPool",
                 "_npu_beginAllocateCurrentThreadToPool"):
        assert out[name].startswith(refused), (name, out[name])
    assert out["end"] == "ran"  # (nothing began: ending is harmless, as torch_npu's own no-op)
    assert out["stream"] and out["after"] == 1 << 20  # refused before any state changed; allocation goes on
