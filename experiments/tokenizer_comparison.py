"""python experiments/tokenizer_comparison.py [--out runs/tokenizer_comparison] [--steps 60]

Bytes vs a trained BPE (`--vocab`, default 2048) on the same text: this Python's standard-library
sources, no download.
1. `jaxscale.data.tokenizer.train_bpe` trains a byte-level BPE of `--vocab` tokens on the training
   files only (the held-out files, chosen by a hash of their names as in `jaxscale.data`, are
   never seen by the tokenizer), with Hugging Face `tokenizers`; `jaxscale.data.shards.prepare`
   writes both tokenizations to shards (the `jaxscale data prepare` path): bytes per token, seconds.
2. The tiny LLaMA (2 layers, dim 128; vocabulary 320 for bytes, --vocab for the BPE) trains for
   `--steps` steps of 16 x 128 tokens on dp=8 with each tokenizer (the default in-memory windows,
   same seed, same schedule), then is evaluated on the same held-out text. The comparison is per
   byte of text, the unit both share: held-out bits per byte = loss (nats/token) x tokens/bytes /
   ln 2 (bytes/token of the held-out text); text bytes per second = tokens/s x bytes/token of
   the training text.
3. The embedding/head share of the step's FLOPs: the head is 6 x dim x vocab FLOPs per token
   (forward + backward) of `ModelConfig.flops_per_token`; the embedding lookup is a gather (no
   FLOPs), but its gradient is a scatter-add into vocab x dim rows (what the H200 profile showed
   as the most expensive fusion with 320 rows: many tokens into few rows).
Under three minutes on 2 idle cores. Writes tokenizers.json and tokenizers.png under --out.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.data import corpus_files, make_batches, shards, tokenizer  # noqa: E402  # noqa: E402
from jaxscale.data.documents import is_heldout  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

SEQ, BATCH, EVAL_BATCHES, MAX_BYTES = 128, 16, 8, 4_000_000


def texts(heldout: bool) -> list[str]:
    out, total = [], 0
    for p in corpus_files("stdlib"):
        raw = p.read_bytes()[: max(0, MAX_BYTES - total)]
        total += len(raw)
        if raw and is_heldout(p.name, 0.05) == heldout:
            out.append(raw.decode("utf-8", errors="replace"))
    return out


def bytes_per_token(tok, texts: list[str]) -> float:
    """Text bytes per predicted token (each document's ids and its EOS; BOS is never a target)."""
    return sum(len(t.encode()) for t in texts) / sum(len(x) + 1 for x in tok.encode_batch(texts))


def run(name: str, tok_spec: str, vocab: int, steps: int, train_text: list[str],
        held_text: list[str]) -> dict:
    cfg = C.config(*C.DP8, f"model.vocab_size={vocab}", f"data.tokenizer={tok_spec}",
                   f"data.max_bytes={MAX_BYTES}", seq=SEQ, batch=BATCH, steps=steps, lr=3e-3)
    tok = tokenizer.load(tok_spec)
    train_b, eval_b = make_batches(cfg.data)
    setup = build(cfg)
    state = setup.init_state()
    sh = setup.batch_shardings()
    times, losses = [], []
    for i in range(steps):
        batch = train_b.device_batch(i, sh)
        t0 = time.perf_counter()
        state, m = setup.train_step(state, batch)
        losses.append(float(jax.device_get(m["loss"])))
        times.append(time.perf_counter() - t0)
    total = count = 0.0
    for i in range(EVAL_BATCHES):
        s, c = setup.eval_step(state.params, eval_b.device_batch(i, sh))
        total, count = total + float(s), count + float(c)
    eval_loss = total / count
    bpt, train_bpt = bytes_per_token(tok, held_text), bytes_per_token(tok, train_text)
    step_s = float(np.median(times[1:]))
    fpt = cfg.model.flops_per_token(SEQ)
    head = 6 * cfg.model.dim * cfg.model.vocab_size
    return {"name": name, "vocab": vocab, "bytes_per_token": bpt,
            "train_bytes_per_token": train_bpt,
            "train_loss": float(np.mean(losses[-5:])), "eval_loss_nats_per_token": eval_loss,
            "bits_per_byte": eval_loss / bpt / math.log(2),
            "step_s": step_s, "tokens_per_s": BATCH * SEQ / step_s,
            "text_bytes_per_s": BATCH * SEQ / step_s * train_bpt,
            "flops_per_token": fpt, "head_share": head / fpt,
            "embedding_rows_per_token": BATCH * SEQ / cfg.model.vocab_size, "losses": losses}


def main():
    args = C.parse_args(__doc__, "runs/tokenizer_comparison", extra=lambda ap: (
        ap.add_argument("--steps", type=int, default=60),
        ap.add_argument("--vocab", type=int, default=2048)))
    t_start = time.time()
    out = Path(args.out)
    claims = C.Claims()
    train_text, held_text = texts(False), texts(True)
    t0 = time.time()
    bpe = tokenizer.train_bpe(train_text, args.vocab, out / "tokenizer")
    train_s = time.time() - t0
    prep = {}
    for name, tok in (("bytes", tokenizer.ByteTokenizer()), (f"bpe{args.vocab}", bpe)):
        t0 = time.time()
        m = shards.prepare(corpus_files("stdlib"), tok, out / f"shards_{name}",
                           max_bytes=MAX_BYTES, source="stdlib")
        prep[name] = {"seconds": time.time() - t0, "tokens": m["splits"]["train"]["n_tokens"] +
                      m["splits"]["heldout"]["n_tokens"], "text_bytes": m["text_bytes"]}
    print(C.table(["tokenizer", "vocab", "text MiB", "tokens", "bytes/token", "prepare s"],
                  [[n, 259 if n == "bytes" else bpe.vocab_size, f"{p['text_bytes'] / C.MiB:.2f}",
                    p["tokens"], f"{p['text_bytes'] / p['tokens']:.2f}", f"{p['seconds']:.2f}"]
                   for n, p in prep.items()],
                  title=f"the same {len(train_text)} + {len(held_text)} stdlib files; BPE "
                        f"trained in {train_s:.1f} s on the training files"))
    vocab_bpe = -(-bpe.vocab_size // 64) * 64
    res = [run("bytes", "bytes", 320, args.steps, train_text, held_text),
           run(f"bpe{args.vocab}", str(bpe.path), vocab_bpe, args.steps, train_text, held_text)]
    print()
    print(C.table(["tokenizer", "model vocab", "held-out bytes/token", "train loss",
                   "held-out nats/tok",
                   "bits/byte", "tokens/s", "text KiB/s", "head share of FLOPs",
                   "batch tokens / vocab row"],
                  [[r["name"], r["vocab"], f"{r['bytes_per_token']:.2f}",
                    f"{r['train_loss']:.3f}", f"{r['eval_loss_nats_per_token']:.3f}",
                    f"{r['bits_per_byte']:.3f}", f"{r['tokens_per_s']:,.0f}",
                    f"{r['text_bytes_per_s'] / 1024:,.0f}", f"{100 * r['head_share']:.1f}%",
                    f"{r['embedding_rows_per_token']:.1f}"] for r in res],
                  title=f"tiny LLaMA (2 layers, dim 128), {args.steps} steps of {BATCH} x {SEQ} "
                        f"tokens, dp=8 on CPU"))
    b, p = res
    claims.check("the BPE packs more text per token (bytes/token)", p["bytes_per_token"],
                 "> 2.5", p["bytes_per_token"] > 2.5)
    claims.check("same steps, same tokens: lower held-out bits per byte with the BPE",
                 f"{p['bits_per_byte']:.3f} vs {b['bits_per_byte']:.3f}", "BPE lower",
                 p["bits_per_byte"] < b["bits_per_byte"])
    claims.check("more text per second with the BPE (KiB/s)",
                 f"{p['text_bytes_per_s'] / 1024:.0f} vs {b['text_bytes_per_s'] / 1024:.0f}",
                 "BPE higher", p["text_bytes_per_s"] > b["text_bytes_per_s"])
    claims.check("the head's FLOP share grows with the vocabulary",
                 f"{100 * p['head_share']:.1f}% vs {100 * b['head_share']:.1f}%", "BPE higher",
                 p["head_share"] > b["head_share"])

    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in res:
        steps = np.arange(1, len(r["losses"]) + 1)
        ax1.plot(steps, np.asarray(r["losses"]) / r["train_bytes_per_token"] / math.log(2),
                 label=f"{r['name']} ({r['train_bytes_per_token']:.2f} bytes/token)")
    ax1.set_xlabel("step (same tokens per step)")
    ax1.set_ylabel("training loss, bits per byte of text")
    ax1.set_title("loss per byte: bytes vs BPE")
    ax1.grid(alpha=0.3)
    ax1.legend()
    names = [r["name"] for r in res]
    heads = [100 * r["head_share"] for r in res]
    ax2.bar(names, [100 - h for h in heads], label="blocks (attention + MLP)", color="C7")
    ax2.bar(names, heads, bottom=[100 - h for h in heads], label="output head", color="C3")
    ax2.set_ylabel("% of training FLOPs per token")
    ax2.set_title("where the FLOPs go (dim 128, 2 layers)")
    ax2.legend(fontsize=8, loc="lower center")
    C.save(fig, args.out, "tokenizers.png")
    (out / "tokenizers.json").write_text(json.dumps({"prepare": prep, "bpe_train_s": train_s,
                                                     "runs": res}, indent=1, default=float))
    print(f"{time.time() - t_start:.0f} s")
    claims.finish(args.out, {"runs": [{k: v for k, v in r.items() if k != "losses"}
                                      for r in res]})


if __name__ == "__main__":
    main()
