"""Train the default model: a small GPT-2 and its own byte-level BPE on the King James text (model/corpus.py).

    python -m kvserve.model.train --out checkpoints/kjv-gpt2

or, from it, a model that quotes its context (speculation's copy-heavy workload, bench/speculation.py): training goes on
from --init's weights and tokenizer, a share of the windows drawn from passages recited after a cue (quote_documents):

    python -m kvserve.model.train --init checkpoints/kjv-gpt2 --quote-share 0.5 --steps 400 --learning-rate 1e-3 \
        --warmup-steps 20 --out artifacts/kjv-quote-gpt2

Reproducible from its arguments: the seed fixes the weights' initialisation and the order of the training
windows; the tokenizer is trained deterministically on the training chapters. What it writes is a
checkpoint directory as save_pretrained writes it (config.json, model.safetensors, tokenizer.json) plus
training.json: the data, its licence, every hyper-parameter, the loss curve and the held-out perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.contract.config import DecoderConfig
from kvserve.errors import UserError
from kvserve.progress import progress

from .checkpoint import save_checkpoint
from .corpus import HELD_OUT_EVERY, load_corpus
from .gpt2 import GPT2

EOS = "<|endoftext|>"
DATA = {
    "text": "King James Version of the Bible (1611), every chapter a document",
    "package": "Debian bible-kjv-text (read through bible-kjv's `bible` program)",
    "licence": "public domain (the translation's copyright has expired; Debian's copyright file says so)",
    "held_out": f"every {HELD_OUT_EVERY}th chapter (kvserve.model.corpus)",
}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab_size: int = 4096  # BPE tokens, EOS included
    n_ctx: int = 256
    d_model: int = 256
    n_head: int = 4
    n_layer: int = 4
    d_mlp: int = 1024
    steps: int = 1500
    batch_size: int = 16  # windows of n_ctx tokens per step
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    log_every: int = 50
    threads: int = 0  # 0: torch's default
    quote_share: float = 0.0  # of the windows, those drawn from quoting documents (a passage, QUOTE_CUE, the passage again)
    init: str = ""  # a checkpoint whose weights and tokenizer training goes on from ("": new ones, seeded)


QUOTE_CUE = "\nAgain:\n"  # what separates a passage from its recital in a quoting document
QUOTE_TOKENS = 96  # a quoted passage's most tokens: consecutive verses while they fit (a whole recital fits in 256)


def train_tokenizer(chapters: tuple[str, ...], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: no text is unencodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(chapters, trainer=trainer)
    return tokenizer


def token_stream(tokenizer, chapters: tuple[str, ...]) -> torch.Tensor:
    """All chapters, each followed by EOS, as one (N,) int64 stream."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(chapters), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def quote_documents(tokenizer, chapters: tuple[str, ...]) -> list[list[int]]:
    """Each chapter cut into passages of consecutive verses of at most QUOTE_TOKENS tokens, each written as
    passage + QUOTE_CUE + the passage again + EOS: the second half can be read off the first."""
    eos, cue = tokenizer.token_to_id(EOS), tokenizer.encode(QUOTE_CUE, add_special_tokens=False).ids
    documents = []
    for chapter in chapters:
        passage: list[int] = []
        for verse in chapter.split("\n"):
            ids = tokenizer.encode(verse + "\n", add_special_tokens=False).ids
            if passage and len(passage) + len(ids) > QUOTE_TOKENS:
                documents.append(passage + cue + passage + [eos])
                passage = []
            if len(ids) <= QUOTE_TOKENS:
                passage += ids
        if passage:
            documents.append(passage + cue + passage + [eos])
    return documents


def recital_prompts(tokenizer, chapters: tuple[str, ...], count: int, min_tokens: int = 48) -> list[tuple[list[int], int]]:
    """(prompt ids, the passage's length) for the first `count` quoting documents of chapters whose passage has at least
    min_tokens tokens: end of text, the passage, QUOTE_CUE; what follows should be the passage again. The end-of-text
    token begins the prompt as it begins each training document (the one before ends there; GPT-2's <|endoftext|> is
    its BOS too): without it the model finds the passage's start less surely and recites less of it."""
    cue, bos = len(tokenizer.encode(QUOTE_CUE, add_special_tokens=False).ids), tokenizer.token_to_id(EOS)
    chosen = []
    for document in quote_documents(tokenizer, chapters):
        passage = (len(document) - 1 - cue) // 2
        if passage >= min_tokens:
            chosen.append(([bos, *document[: passage + cue]], passage))
        if len(chosen) == count:
            break
    return chosen


@torch.no_grad()
def recital_accuracy(model: GPT2, documents: list[list[int]], cue_length: int) -> float:
    """Of the recited tokens of quoting documents (after QUOTE_CUE), the share the model's greedy choice gets right given
    the text before each (teacher-forced): how well it copies its context."""
    model.eval()
    right = total = 0
    for document in documents:
        if len(document) - 1 > model.config.n_ctx:  # longer than the model's context: not scored
            continue
        ids = torch.tensor([document[:-1]])  # (1, T)
        positions = torch.arange(ids.shape[1])[None]  # (1, T)
        logits, _ = model(ids, torch.ones_like(ids), positions, model.empty_cache(1))  # (1, T, V)
        start = (len(document) - 1 + cue_length) // 2  # the recital's first token: passage and cue before it
        predicted, target = logits[0, start - 1 :].argmax(-1), torch.tensor(document[start:])  # each token after the one before
        right += int((predicted == target).sum())
        total += len(target)
    return right / max(total, 1)


def causal_lm_loss(model: GPT2, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over (B, T+1) windows, through the same forward the export traces."""
    inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
    B, T = inputs.shape
    positions = torch.arange(T).expand(B, T)  # (B, T)
    logits, _ = model(inputs, torch.ones(B, T, dtype=torch.int64), positions, model.empty_cache(B))  # (B, T, V)
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


def token_stream_of(documents: list[list[int]]) -> torch.Tensor:
    """Documents (each ending in EOS already) as one (N,) int64 stream."""
    return torch.tensor([token for document in documents for token in document], dtype=torch.int64)


def sample_windows(stream: torch.Tensor | None, count: int, n_ctx: int, generator: torch.Generator) -> torch.Tensor:
    """count random windows of n_ctx + 1 tokens of stream: (count, n_ctx + 1)."""
    if not count:
        return torch.zeros((0, n_ctx + 1), dtype=torch.int64)
    starts = torch.randint(0, len(stream) - n_ctx - 1, (count,), generator=generator)
    return torch.stack([stream[s : s + n_ctx + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model: GPT2, stream: torch.Tensor, n_ctx: int) -> float:
    """exp(mean next-token loss) over the stream cut into consecutive windows of n_ctx + 1 tokens."""
    model.eval()
    usable = (len(stream) - 1) // n_ctx * n_ctx
    starts = torch.arange(0, usable, n_ctx)
    total, count = 0.0, 0
    for batch in starts.split(16):
        windows = torch.stack([stream[s : s + n_ctx + 1] for s in batch.tolist()])  # (B, n_ctx + 1)
        total += causal_lm_loss(model, windows).item() * windows.shape[0] * n_ctx
        count += windows.shape[0] * n_ctx
    return math.exp(total / count)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(config: TrainConfig, out: Path) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    corpus = load_corpus()
    if config.init:  # go on from a trained checkpoint: its weights, its tokenizer, its shape
        from tokenizers import Tokenizer

        from .checkpoint import load_checkpoint

        tokenizer = Tokenizer.from_file(str(Path(config.init) / "tokenizer.json"))
        model = load_checkpoint(config.init)
        if not isinstance(model, GPT2):
            raise UserError(f"--init {config.init} is not a GPT-2 checkpoint (training goes on from GPT-2's alone)")
    else:
        tokenizer = train_tokenizer(corpus.train, config.vocab_size)
    train_ids = token_stream(tokenizer, corpus.train)
    held_ids = token_stream(tokenizer, corpus.held_out)
    if not config.init:
        decoder = DecoderConfig(
            vocab_size=tokenizer.get_vocab_size(),
            n_ctx=config.n_ctx,
            d_model=config.d_model,
            n_head=config.n_head,
            n_layer=config.n_layer,
            d_mlp=config.d_mlp,
            eos_token_ids=(tokenizer.token_to_id(EOS),),
        )
        model = GPT2(decoder).init_weights(config.seed)
    n_ctx = model.config.n_ctx
    quotes = token_stream_of(quote_documents(tokenizer, corpus.train)) if config.quote_share else None
    held_quotes = quote_documents(tokenizer, corpus.held_out)[:64]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(config.seed)
    curve = []
    started = time.perf_counter()
    running = 0.0
    model.train()
    for step in progress(range(config.steps), config.steps, "training steps"):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        quoting = int(round(config.batch_size * config.quote_share))
        windows = torch.cat([sample_windows(train_ids, config.batch_size - quoting, n_ctx, generator),
                             sample_windows(quotes, quoting, n_ctx, generator)])  # (B, n_ctx + 1)
        loss = causal_lm_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            window = (step % config.log_every) + 1
            point = {"step": step + 1, "loss": round(running / window, 4), "seconds": round(time.perf_counter() - started, 1)}
            curve.append(point)
            print(json.dumps(point), flush=True)
            running = 0.0
    model.eval()
    held_out_ppl = perplexity(model, held_ids, n_ctx)
    record = {
        "data": DATA | {"train_tokens": len(train_ids), "held_out_tokens": len(held_ids)}
        | ({"quoting": f"{config.quote_share:.0%} of the windows from passages of at most {QUOTE_TOKENS} tokens, each followed by "
                       f"{QUOTE_CUE!r} and the passage again ({len(quotes)} tokens)"} if quotes is not None else {}),
        "config": asdict(config),
        "torch": torch.__version__,
        "train_seconds": round(time.perf_counter() - started, 1),
        "held_out_perplexity": round(held_out_ppl, 3),
        "held_out_recital_accuracy": round(recital_accuracy(model, held_quotes, len(tokenizer.encode(QUOTE_CUE, add_special_tokens=False).ids)), 4),
        "loss_curve": curve,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# The model learned plain text, not conversations; so that a chat client can still talk to it (serve renders a
# conversation with the artifact's template, contract/chat.py), a turn becomes a line "Role: content" after the system
# message, and the reply follows "Assistant:". Tools a request offers are listed first, with the hermes call format
# (<tool_call> blocks, service/core/tool_calls.py), so a request can hold the reply to calls of them.
CHAT_TEMPLATE = """{#- kvserve's default model (the trained KJV GPT-2) learned plain text, not conversations: a system message stands
    first as it is, each other turn is a line 'Role: content', and the assistant's turn is opened for the reply. Tools,
    when offered, come first, one JSON line each (the function: its name, description and parameters), with how a call
    is written (the model's context is 256 tokens: every one counts); a turn's calls follow its content. -#}
{% if tools %}
{{ 'Tools:\\n' }}{% for tool in tools %}{{ tool['function'] | tojson + '\\n' }}{% endfor %}
{{- 'Call one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n\\n' }}
{%- endif %}
{% for message in messages %}
{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% else %}{{ message['role'] | capitalize + ': ' + message['content'] }}
{%- if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}
{{- '<tool_call>\\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson + '\\n</tool_call>' }}
{%- endfor %}{% endif %}{{ '\\n' }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    for name, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    optional = ("seed", "threads", "weight_decay", "quote_share")
    bad = [name for name, value in args.items()
           if not isinstance(value, str) and (value < 0 or (value == 0 and name not in optional) or (name == "quote_share" and value > 1))]
    try:
        if bad:
            raise UserError(f"--{bad[0].replace('_', '-')} must be {'in [0, 1]' if bad[0] == 'quote_share' else 'positive'}, "
                            f"got {args[bad[0]]}")
        if args["init"] and not (Path(args["init"]) / "tokenizer.json").is_file():
            raise UserError(f"--init {args['init']}: no checkpoint with a tokenizer.json there")
        record = train(TrainConfig(**args), out)
    except (UserError, ValueError) as exc:  # a bad value, no King James text installed, a config DecoderConfig refuses
        print(f"kvserve.model.train: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"held-out perplexity {record['held_out_perplexity']} after {record['train_seconds']} s -> {out}")


if __name__ == "__main__":
    main()
