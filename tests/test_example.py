"""examples/train_longnet.py: a few dozen steps of a tiny model on the CPU learn something."""

import importlib.util
import json
import os
import statistics

import pytest
import torch

import dilated_attn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 40 steps of a 2-layer, 32-wide model on 64-byte windows: about 0.4 s. Over seeds 0-9 the loss falls from
# ~5.4 (ln 256 = 5.55) to 3.4-3.65 in the last 5 steps, so a margin of 1.0 nat is far from flaky.
TINY = ["--device", "cpu", "--steps", "40", "--seq-len", "64", "--batch", "8", "--dim", "32", "--layers", "2",
        "--heads", "2", "--segment-lengths", "16", "32", "64", "--dilation-rates", "1", "2", "4", "--log-every", "10"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_longnet", os.path.join(ROOT, "examples", "train_longnet.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed, extra", [(0, []), (1, ["--untied"])])
def test_loss_falls(example, seed, extra, tmp_path, capsys):
    path = tmp_path / "loss.json"
    result = example.main([*TINY, "--seed", str(seed), "--json", str(path), *extra])
    losses = result["losses"]
    assert len(losses) == 40
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 1.0, losses
    assert result["held_out_loss"] < 4.5  # ln 256 = 5.55 for a model that learned nothing
    assert json.loads(path.read_text())["losses"] == losses
    out = capsys.readouterr().out
    assert out.count("tokens/s") == 5 and "step     40  loss" in out


def test_bad_arguments(example, capsys):
    with pytest.raises(SystemExit) as exc:
        example.main(["--device", "cpu", "--dim", "30", "--heads", "4"])
    assert exc.value.code == 2 and "embed_dim (30) must be divisible by num_heads (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--steps", "0"])
    assert "--steps must be a positive integer, got 0" in capsys.readouterr().err


def test_help(example, capsys):
    with pytest.raises(SystemExit) as exc:
        example.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert exc.value.code == 0
    assert "averaged across ranks" in out and "summed" not in out
    for default in ("300", "512", "[64, 128, 256, 512]", "[1, 2, 4, 8]", "0.003", "25", "False"):
        assert f"(default: {default})" in out, default
    assert "(default: None)" not in out and "(default: cuda if available, else cpu)" in out
    ap, _ = example.parse_args(["--device", "cpu"])
    assert all(action.help for action in ap._actions), [a.dest for a in ap._actions if not a.help]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot(example, tmp_path):
    png = tmp_path / "loss.png"
    example.main([*TINY, "--steps", "4", "--plot", str(png)])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sequence_parallel_training_matches_one_process(example, tmp_path):
    """torchrun with 2 CPU processes (gloo, ring attention, zigzag shards): the same losses as one process,
    since the ring computes the same function and the weight gradients are averaged across ranks."""
    import subprocess
    import sys

    args = [*TINY, "--steps", "6", "--log-every", "3"]
    single = example.main([*args, "--json", str(tmp_path / "one.json")])["losses"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the same dilated_attn as this process imports (PYTHONPATH kept)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(ROOT, "examples", "train_longnet.py"), *args,
                          "--json", str(tmp_path / "two.json")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sequence parallel over 2 ranks" in run.stdout
    ring = json.loads((tmp_path / "two.json").read_text())["losses"]
    assert ring == pytest.approx(single, rel=1e-4, abs=1e-4)


def test_generate_with_kv_cache_matches_recomputing_the_prefix(example):
    """Greedy generation over KV caches (the prompt in one chunk, then a token per step) gives the tokens that
    recomputing the whole prefix every step gives."""
    torch.manual_seed(0)
    model = example.LongNetLM(32, 2, 4, 64, [8, 16, 32], [1, 2, 4]).double().eval()
    prompt = torch.randint(0, 256, (2, 11))
    got = model.generate(prompt, 20)
    want = prompt
    with torch.no_grad():
        for _ in range(20):
            want = torch.cat([want, model(want)[:, -1:].argmax(-1)], dim=1)
    assert got.shape == (2, 31) and torch.equal(got, want)
    # the logits too, not only their argmax: the last step's, over the caches and recomputed
    caches = [dilated_attn.KVCache(2, 31, 4, 8, dtype=torch.float64) for _ in model.blocks]
    with torch.no_grad():
        model(got[:, :30], caches)
        step = model(got[:, 30:], caches)
        full = model(got)
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="exceeds the model's max_len 64"):
        model.generate(prompt, 60)
