"""Which configs the Triton kernels run: the shipped table, its lookup, the heuristic for GPUs it lacks, and that a
default call runs no autotuning sweep (benchmarks/tune.py writes the table; docs/backends.md, "Configs")."""

import json

import pytest
import torch

import dilated_attn

triton = pytest.importorskip("triton")

from dilated_attn.backends.triton import configs, ops  # noqa: E402 - after the importorskip

HAS_CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run where there is no GPU")

# Shared memory per block (opt-in) of each family's GPUs: A100; A10/L4/RTX 30-40 (the smallest of them);
# H100/H200; B200; RTX 50
SHARED_MEMORY = {"sm_80": 166912, "sm_86": 101376, "sm_90": 232448, "sm_100": 232448, "sm_120": 101376}
ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def cfg(block_m, block_n, warps=4, stages=2):
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps, num_stages=stages)


def key(gpu="sm_90", dtype="bfloat16", precision=None, block_d=128, causal=False, members=2048):
    return configs.Key(gpu, dtype, precision, block_d, causal, members)


def entry(block_m, block_n=32, stages=2):
    return {name: cfg(block_m, block_n, stages=stages) for name in ("fwd", "dkdv", "dq")}


@pytest.fixture
def fake_table(monkeypatch):
    """A small table in place of the shipped one: sm_90 bfloat16 head-dim-128 entries at two buckets."""
    # the forward's bucket-2048 config needs 128 KiB of shared memory at head dim 128: more than sm_86 has
    table = {key(members=64): entry(16), key(members=2048): entry(128, 64, 3),
             key(causal=True, members=2048): entry(32)}
    monkeypatch.setattr(configs, "load_table", lambda path=None: table)
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the interpreter's one small config aside
    configs._select.cache_clear()
    yield table
    configs._select.cache_clear()


def test_gpu_family_and_members_bucket():
    assert [configs.gpu_family(c) for c in [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]] == [
        "sm_70", "sm_75", "sm_80", "sm_86", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert [configs.members_bucket(m) for m in (0, 1, 2, 3, 64, 65, 2048, 8192, 8193, 10**6)] == [
        1, 1, 2, 4, 64, 128, 2048, 8192, 8192, 8192]


def test_lookup_exact_nearest_bucket_and_none(fake_table):
    assert configs.lookup(key(members=2048)) is fake_table[key(members=2048)]
    assert configs.lookup(key(members=4096)) is fake_table[key(members=2048)]
    assert configs.lookup(key(members=128)) is fake_table[key(members=64)]
    assert configs.lookup(key(members=1)) is fake_table[key(members=64)]
    # 2^6 and 2^11 are equally far (in log2) from 2^8.5: no such bucket, but a tie of 256 vs 512 goes up
    table = {key(members=256): entry(16), key(members=1024): entry(64)}
    assert configs.lookup(key(members=512), table) is table[key(members=1024)]
    # a key differing in anything but the bucket finds nothing
    for other in (key(gpu="sm_80"), key(dtype="float16"), key(block_d=64), key(precision="tf32")):
        assert configs.lookup(other) is None
    assert configs.lookup(key(causal=True, members=64)) is fake_table[key(causal=True, members=2048)]


def test_select_table_heuristic_and_fallback(fake_table):
    fwd = ops.FORWARD
    big = SHARED_MEMORY["sm_90"]
    assert configs.select(fwd, key(members=2048), 2, big) is fake_table[key(members=2048)]["fwd"]
    # another family takes the sm_90 entry where it fits its shared memory...
    assert fwd.shared_memory(fake_table[key(members=2048)]["fwd"], 128, 2, None) == 128 * 1024
    got = configs.select(fwd, key(gpu="sm_80", members=2048), 2, SHARED_MEMORY["sm_80"])
    assert got is fake_table[key(members=2048)]["fwd"]
    # ... and the first candidate that fits where it does not
    small = SHARED_MEMORY["sm_86"]
    got = configs.select(fwd, key(gpu="sm_86", members=2048), 2, small)
    assert got is fwd.fitting(128, 2, None, small)[0] and fwd.shared_memory(got, 128, 2, None) <= small
    # no entry at all (float16 here): the first candidate that fits
    assert configs.select(fwd, key(dtype="float16"), 2, big) is fwd.fitting(128, 2, None, big)[0]
    assert configs.select(fwd, key(dtype="float16"), 2, big) is fwd.candidates[0]


def test_warmup_buckets_follow_the_table(fake_table, monkeypatch):
    """`dilated-attn warmup` runs a family once per members bucket of its table entries (those of the heuristic's
    family on a GPU the table lacks), and once where no entry exists (one config for every bucket then)."""
    from dilated_attn import warmup

    capability = (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    assert warmup.members_buckets(cuda, "bfloat16", 128, False) == (64, 2048)
    assert warmup.members_buckets(cuda, "bfloat16", 128, True) == (2048,)
    assert warmup.members_buckets(cuda, "bfloat16", 100, True) == (2048,)  # head dim 100: the tile of 128
    assert warmup.members_buckets(cuda, "float16", 128, False) == (configs.MAX_MEMBERS_BUCKET,)
    capability = (8, 6)
    assert warmup.members_buckets(cuda, "bfloat16", 128, False) == (64, 2048)
    families = warmup.families(cuda, ["bfloat16", "float16"], [128], [False])
    assert families == [warmup.Family("bfloat16", 128, False, (64, 2048)),
                        warmup.Family("float16", 128, False, (configs.MAX_MEMBERS_BUCKET,))]


def test_fitting_keeps_tf32x3_candidates_for_tf32x3_only():
    for t in ops.TUNABLES:
        plain = t.fitting(128, 4, "ieee", 1 << 30)
        assert plain == list(t.candidates)
        assert t.fitting(128, 4, "tf32x3", 1 << 30) == list(t.candidates + t.tf32x3_candidates)
        # nothing fits: the smallest one
        (smallest,) = t.fitting(128, 4, "tf32x3", 1)
        assert smallest is min(t.candidates + t.tf32x3_candidates, key=lambda c: t.shared_memory(c, 128, 4, "tf32x3"))


def test_shipped_table_names_its_sources_and_covers_the_readme_families():
    data = json.loads(configs.TABLE_PATH.read_text())
    assert data["entries"], "the shipped table is empty"
    for e in data["entries"]:
        source = data["sources"][e["source"]]
        assert source["device"] and source["command"].startswith("python benchmarks/tune.py"), source
        assert e["gpu"] == configs.gpu_family(tuple(map(int, source["capability"].split(".")))), e
        assert (e["precision"] is None) == (e["dtype"] != "float32"), e
        assert e["members"] == configs.members_bucket(e["members"]) and e["block_d"] in (16, 32, 64, 128, 256), e
    table = configs.load_table()
    for dtype, block_d, causal in [("bfloat16", 128, False), ("bfloat16", 128, True), ("float16", 64, False)]:
        assert key(dtype=dtype, block_d=block_d, causal=causal, members=2048) in table


def test_shipped_configs_fit_their_gpu_family():
    for k, kernels in configs.load_table().items():
        for t in ops.TUNABLES:
            config = kernels[t.name]
            assert config in t.candidates_for(k.precision), (k, t.name, config)
            assert t.shared_memory(config, k.block_d, ELEMENT_SIZE[k.dtype], k.precision) <= SHARED_MEMORY[k.gpu]


def _table_shapes():
    """Per head-dim tile, each kernel's distinct (BLOCK_M, BLOCK_N) in the shipped table."""
    shapes = {}
    for k, kernels in configs.load_table().items():
        for name, config in kernels.items():
            shapes.setdefault(k.block_d, {}).setdefault(name, set()).add(
                (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]))
    return {d: {name: sorted(s) for name, s in by_kernel.items()} for d, by_kernel in sorted(shapes.items())}


@interpreter
@pytest.mark.parametrize("block_d", sorted(_table_shapes()))
def test_interpreter_table_block_shapes(block_d, monkeypatch):
    """Every block shape of the shipped table, at its head-dim tile, against the reference (under the
    interpreter, which ignores num_warps and num_stages): full, partial and diagonal blocks, with dilation.

    Each round's length is twice its largest block plus 33: every kernel takes the same loop paths (mask-free,
    diagonal and partial blocks, none, one and several of each; partial query and key blocks; a kv head's later
    query heads) as at a length of 300 (checked offline), in less of the interpreter's time where blocks are small."""
    from cases import Case
    from parity import check_against_reference

    shapes = _table_shapes()[block_d]
    for i in range(max(len(s) for s in shapes.values())):
        largest = 0
        for t in ops.TUNABLES:
            block_m, block_n = shapes[t.name][i % len(shapes[t.name])]
            monkeypatch.setitem(configs.FORCED, t.name, cfg(block_m, block_n))
            largest = max(largest, block_m, block_n)
        N = 2 * largest + 33
        case = Case(1, N, 2, 1, block_d, (N, N // 2), (1, 2), "all", i % 2 == 1, "contiguous")
        check_against_reference(case, torch.float32, "cpu", i, "triton")


@interpreter
@pytest.mark.parametrize("autotune", [False, True])
def test_default_call_runs_no_autotuning_sweep(autotune, monkeypatch):
    """A default call benchmarks no config; with AUTOTUNE (DILATED_ATTN_AUTOTUNE=1) the sweep benchmarks every
    candidate of each kernel (the control: the count would see a sweep). Timings are faked: the interpreter
    cannot time kernels."""
    from triton.runtime.autotuner import Autotuner

    benched = []

    def fake_bench(self, *args, config, **meta):
        benched.append((self.base_fn.__name__, config))
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(Autotuner, "_bench", fake_bench)
    monkeypatch.setattr(configs, "AUTOTUNE", autotune)
    for t in ops.TUNABLES:
        monkeypatch.setattr(t, "_autotuner", None)  # a fresh sweep, no results of earlier tests
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    out = dilated_attn.dilated_attention(q, k, v, [8, 16], [1, 2], backend="triton")  # one members bucket
    out.sum().backward()
    if autotune:
        counts = {name: sum(1 for n, _ in benched if n == name) for name, _ in benched}
        assert counts == {t.fn.__name__: len(t.candidates) for t in ops.TUNABLES}
    else:
        assert benched == []
        assert all(t._autotuner is None for t in ops.TUNABLES)
