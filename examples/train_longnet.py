"""A small LongNet-style byte-level language model, trained with dilated_attn on a corpus that needs no
download: the Python standard library's own source (the *.py files next to the `os` module), as bytes.

    python examples/train_longnet.py                      # a quick run on the CPU, or on the GPU if there is one
    python examples/train_longnet.py --device cuda --steps 2000 --seq-len 8192 --batch 4 --dim 512 --layers 6 \\
        --heads 8 --segment-lengths 512 1024 2048 4096 8192 --dilation-rates 1 2 4 8 16 --json loss.json --plot loss.png

Model: byte embedding plus learned positions; `--layers` pre-norm blocks, each a causal
dilated_attn.MultiheadDilatedAttention (with MAGNETO's sub-LayerNorm) and a GELU MLP; a final LayerNorm and
an output head tied to the embedding (--untied for a separate one). AdamW with linear warm-up and cosine
decay, gradients clipped at 1; bfloat16 autocast on a GPU (--dtype float32 turns it off). Every --log-every
steps it prints the step, the mean loss, the learning rate and tokens/s; at the end, the loss on windows from
the held-out last 5% of the corpus. --json writes the loss curve and the run's settings and results, --plot
draws the curve (needs matplotlib).

Sequence parallel: launched by torchrun with several processes, every rank holds a zigzag shard of each
window (dilated_attn.shard) and the attention runs as dilated_attn.ring_attention (the modules'
process_group); weight gradients are averaged across ranks (all-reduced, then divided by the number of
ranks), so every rank takes the step that one process would take on the full windows:

    torchrun --nproc_per_node=2 examples/train_longnet.py --seq-len 16384 ...   # NCCL on GPUs, gloo on CPUs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dilated_attn
from dilated_attn import MultiheadDilatedAttention

VOCAB = 256  # bytes
HELD_OUT = 0.05  # the tail of the corpus kept for the final evaluation


def load_corpus() -> tuple[torch.Tensor, dict]:
    """The standard library's top-level *.py files, sorted by name and concatenated, as a uint8 tensor."""
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    parts = []
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read())
    data = b"".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), dict(path=root, files=len(names), bytes=len(data))


class Block(nn.Module):
    def __init__(self, dim, heads, segment_lengths, dilation_rates, group=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiheadDilatedAttention(dim, heads, dilation_rates, segment_lengths, process_group=group,
                                              layout="zigzag")
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.norm1(x), is_causal=True, kv_cache=kv_cache)[0]
        return x + self.mlp(self.norm2(x))


class LongNetLM(nn.Module):
    def __init__(self, dim, layers, heads, max_len, segment_lengths, dilation_rates, tied=True, group=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        # Small embeddings: with the tied head the first logits are near zero, so training starts at ln(256).
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, segment_lengths, dilation_rates, group) for _ in range(layers))
        self.sharded = group is not None
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens, kv_caches=None):
        """[B, N] bytes as int64 -> logits [B, N, 256]. Sharded: this rank's positions. With kv_caches (one
        dilated_attn.KVCache per block, under torch.no_grad()): the tokens that follow the cached ones."""
        if self.sharded:  # the positions of this rank's zigzag shard of the window
            n = tokens.shape[1] * dist.get_world_size()
            positions = dilated_attn.shard(torch.arange(n, device=tokens.device), layout="zigzag", dim=0)
            x = self.embed(tokens) + self.pos[positions]
        else:
            start = kv_caches[0].length if kv_caches else 0
            x = self.embed(tokens) + self.pos[start:start + tokens.shape[1]]
        for block, cache in zip(self.blocks, kv_caches or [None] * len(self.blocks)):
            x = block(x, cache)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, prompt, steps):
        """Greedy decoding: the prompt [B, P] in one causal pass into fresh KV caches, then one token per step
        over them. Returns [B, P + steps]."""
        if self.sharded:
            raise ValueError("generate runs on one process: build the model without a process group")
        total = prompt.shape[1] + steps
        if total > self.pos.shape[0]:
            raise ValueError(f"prompt + steps = {total} exceeds the model's max_len {self.pos.shape[0]}")
        caches = [dilated_attn.KVCache(prompt.shape[0], total, b.attn.num_kv_heads, b.attn.head_dim,
                                       device=prompt.device, dtype=self.pos.dtype) for b in self.blocks]
        tokens, logits = [prompt], self(prompt, caches)
        for step in range(steps):
            tokens.append(logits[:, -1:].argmax(-1))
            if step + 1 < steps:
                logits = self(tokens[-1], caches)
        return torch.cat(tokens, dim=1)


def random_windows(data, batch, seq_len, generator):
    """`batch` random windows of seq_len + 1 bytes: inputs and next-byte targets, [batch, seq_len] each."""
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=generator)
    window = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return window[:, :-1], window[:, 1:]


def lr_at(step, steps, lr):
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of `lr`."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def loss_of(model, x, y, device, dtype):
    """Mean next-byte loss of the batch; sequence-parallel: of this rank's shard (equal shares on every rank,
    so the mean over ranks is the batch's mean)."""
    if model.sharded:
        x, y = (dilated_attn.shard(t, layout="zigzag") for t in (x, y))
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x.to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


@torch.no_grad()
def held_out_loss(model, data, args, device, dtype, batches=4):
    """Mean loss over consecutive windows at the start of the held-out tail (the same windows every run)."""
    model.eval()
    n = args.seq_len
    count = min(batches * args.batch, (len(data) - 1) // n)
    if count == 0:  # a window longer than the held-out tail
        return math.nan
    starts = torch.arange(count) * n
    window = data[starts[:, None] + torch.arange(n + 1)].long()
    losses = [mean_over_ranks(loss_of(model, window[i : i + args.batch, :-1], window[i : i + args.batch, 1:],
                                      device, dtype)).item()
              for i in range(0, count, args.batch)]
    model.train()
    return sum(losses) / len(losses)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and "(default: ...)" after the help of each option whose default is not
    None (those options state their default in their help)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ap.add_argument("--seq-len", type=int, default=512,
                    help="window length in bytes; with torchrun, divisible by 2 x the number of processes")
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--dim", type=int, default=128, help="model width (embed_dim)")
    ap.add_argument("--layers", type=int, default=2, help="number of blocks")
    ap.add_argument("--heads", type=int, default=4, help="attention heads per block (must divide --dim)")
    ap.add_argument("--segment-lengths", type=int, nargs="+", default=[64, 128, 256, 512], metavar="W",
                    help="segment length of each attention branch")
    ap.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4, 8], metavar="R",
                    help="dilation rate of each attention branch, one per segment length")
    ap.add_argument("--untied", action="store_true", help="a separate output head instead of the embedding's")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="peak learning rate: linear warm-up over the first 10%% of the steps, then cosine "
                         "decay to 10%% of it")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="autocast dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the training windows")
    ap.add_argument("--log-every", type=int, default=25, help="print the mean loss every this many steps")
    ap.add_argument("--json", metavar="PATH", help="write the loss curve and the run's summary as JSON")
    ap.add_argument("--plot", metavar="PATH", help="draw the loss curve to a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    for name in ("steps", "seq_len", "batch", "dim", "layers", "heads", "log_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if not args.lr > 0:
        ap.error(f"--lr must be positive, got {args.lr}")
    try:
        args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        ap.error(f"--device: not a device: {args.device!r}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked now, not after the training run)
        except ImportError:
            ap.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    return ap, args


def main(argv=None) -> dict:
    ap, args = parse_args(argv)
    process_group, rank = None, 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: sequence parallel over the ranks
        if args.device.type == "cuda":
            args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo")
        process_group, rank = dist.group.WORLD, dist.get_rank()
        if args.seq_len % (2 * dist.get_world_size()):
            ap.error(f"--seq-len must be divisible by 2 x the number of processes ({2 * dist.get_world_size()})")
    device, dtype = args.device, args.dtype
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    data, corpus = load_corpus()
    split = int(len(data) * (1 - HELD_OUT))
    train_data, held_out = data[:split], data[split:]
    try:  # bad attention arguments (say --dim not divisible by --heads) get the module's own message
        model = LongNetLM(args.dim, args.layers, args.heads, args.seq_len, args.segment_lengths, args.dilation_rates,
                          tied=not args.untied, group=process_group).to(device)
    except (ValueError, TypeError) as exc:
        ap.error(str(exc))
    params = sum(p.numel() for p in model.parameters())
    log(f"corpus: {corpus['files']} files, {corpus['bytes']:,} bytes from {corpus['path']}; model: {params:,} "
        f"parameters on {device}, {str(dtype).removeprefix('torch.')}"
        + (f"; sequence parallel over {dist.get_world_size()} ranks" if process_group is not None else ""), flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)

    losses = []  # per step, kept on the device until a log line needs them (no host sync every step)
    start = last = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        x, y = random_windows(train_data, args.batch, args.seq_len, generator)
        loss = loss_of(model, x, y, device, dtype)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Sequence parallel: the ranks' gradients sum to that of the sum of their losses (each the mean over
        # an equal shard), so their mean is the gradient of the batch's mean loss.
        if process_group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            loss = mean_over_ranks(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = torch.stack(losses[-args.log_every:]).mean().item()  # .item() waits for the GPU
            now = time.perf_counter()
            steps_done = (step % args.log_every) + 1
            log(f"step {step + 1:6d}  loss {recent:.4f}  lr {lr_at(step, args.steps, args.lr):.2e}  "
                  f"{steps_done * args.batch * args.seq_len / (now - last):,.0f} tokens/s", flush=True)
            last = now
    elapsed = time.perf_counter() - start
    curve = torch.stack(losses).tolist()
    final = held_out_loss(model, held_out, args, device, dtype)
    log(f"held-out loss {final:.4f} ({final / math.log(2):.3f} bits per byte); "
          f"{args.steps * args.batch * args.seq_len / elapsed:,.0f} tokens/s overall", flush=True)

    config = {k: str(v) if isinstance(v, (torch.device, torch.dtype)) else v for k, v in vars(args).items()}
    result = dict(config=config, corpus=corpus, parameters=params, losses=curve, held_out_loss=final,
                  tokens_per_s=args.steps * args.batch * args.seq_len / elapsed)
    if process_group is not None:
        # every rank done with its collectives before any tears its connections down (a gloo peer whose
        # partner left first can abort at exit)
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return result
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
        ax.plot(range(1, len(curve) + 1), curve, linewidth=1, label="training loss")
        ax.axhline(final, color="tab:red", linestyle="--", label=f"held-out loss at the end ({final:.3f})")
        ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)", title="LongNet byte LM on the Python stdlib")
        ax.grid(alpha=0.3)
        ax.legend()
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
    if "LOCAL_RANK" in os.environ:  # a torchrun rank, its process group destroyed and its results written
        # Leave without the interpreter's teardown: at exit gloo's threads occasionally abort the process ("terminate
        # called without an active exception") after a clean destroy_process_group, torch's failure, not the run's.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
