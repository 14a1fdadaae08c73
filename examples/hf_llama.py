"""A small Llama from Hugging Face transformers, built from a LlamaConfig (nothing is downloaded), running dilated
attention as its attention implementation: trained for a few steps on random token data, then greedy generation
with model.generate. Needs transformers 5.x (pip install "transformers>=5,<6").

    python examples/hf_llama.py                     # a few seconds on a CPU
    python examples/hf_llama.py --device cuda --steps 100 --seq-len 256 --batch 32 --new-tokens 64 \\
        --segment-lengths 32 64 128 256 --dilation-rates 1 2 4 8

The data: --batch sequences of random tokens, the same every step, which the model learns by heart: the loss
falls from about ln(vocab) = 4.85 towards 0. Generation is then prompted with the start of the first sequence, and
the script prints how many of the generated tokens are the ones that follow in that sequence.

The three lines that switch a transformers model to dilated attention:

    import dilated_attn.integrations.transformers as dilated_hf
    dilated_hf.register()
    config.dilated_attention = {"segment_lengths": [...], "dilation_rates": [...]}, then
    AutoModelForCausalLM.from_config(config, attn_implementation="dilated_attention")  (or from_pretrained)
"""

from __future__ import annotations

import argparse
import time

import torch

VOCAB = 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    ap.add_argument("--batch", type=int, default=8, help="random sequences, all trained on every step (default: 8)")
    ap.add_argument("--prompt-len", type=int, default=16,
                    help="tokens of the first sequence that prompt the generation (default: 16)")
    ap.add_argument("--segment-lengths", type=int, nargs="+", default=[16, 32, 64], metavar="W",
                    help="segment length of each attention branch (default: 16 32 64)")
    ap.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4], metavar="R",
                    help="dilation rate of each branch, one per segment length (default: 1 2 4)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 0.01)")
    ap.add_argument("--new-tokens", type=int, default=16,
                    help="tokens to generate after the prompt; at most --seq-len - --prompt-len (default: 16)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    ap.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps (default: 10)")
    args = ap.parse_args(argv)
    for name in ("steps", "seq_len", "batch", "prompt_len", "new_tokens", "log_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.prompt_len + args.new_tokens > args.seq_len:
        ap.error(f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) must be at most --seq-len "
                 f"({args.seq_len})")
    if args.seq_len > 256:
        ap.error(f"--seq-len must be at most 256 (the model's max_position_embeddings), got {args.seq_len}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return ap, args


def main(argv=None) -> dict:
    ap, args = parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        ap.error('this example needs transformers 5.x: pip install "transformers>=5,<6"')
    import dilated_attn.integrations.transformers as dilated_hf

    dilated_hf.register()  # attn_implementation="dilated_attention"
    torch.manual_seed(args.seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.dilated_attention = {"segment_lengths": args.segment_lengths, "dilation_rates": args.dilation_rates}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilated_attention").to(args.device)
    print(f"Llama: {sum(p.numel() for p in model.parameters()):,} parameters on {args.device}, attention "
          f"{model.config._attn_implementation} with branches {args.segment_lengths} / {args.dilation_rates}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len)).to(args.device)
    losses, start = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss  # next-token loss (transformers shifts the labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}")
    print(f"trained in {time.perf_counter() - start:.1f} s")

    model.eval()  # greedy decoding over transformers' KV cache: dilated_attention_with_kvcache after the prompt
    prompt = tokens[:1, :args.prompt_len]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                         do_sample=False)
    generated = out[0, args.prompt_len:].tolist()
    expected = tokens[0, args.prompt_len:args.prompt_len + args.new_tokens].tolist()
    correct = sum(g == e for g, e in zip(generated, expected))
    print(f"generated {generated}\nexpected  {expected}  ({correct}/{args.new_tokens} match)")
    return dict(losses=losses, generated=generated, correct=correct)


if __name__ == "__main__":
    main()
