"""The offline default teacher: a small Llama (or BERT encoder) pre-trained briefly on the
pydoc corpus.

With no network there is no hub checkpoint to distill, and a randomly initialised
teacher would make every distillation metric meaningless. So on first use we train a
byte-level BPE tokenizer and pre-train a small LlamaForCausalLM on the *train* split
of the pydoc corpus (the same split the app uses, so held-out numbers stay honest),
then save the result as an ordinary `save_pretrained` directory that
`Teacher.from_pretrained` and `AutoTokenizer.from_pretrained` load offline.

What names a teacher is its recipe (``tiny_recipe.py``); where it is cached and who
builds it, once, is ``tiny_cache.py``, which calls :func:`build_teacher` /
:func:`build_bert` here on a cache miss.

Shape legend:
    B: batch size (chunks per step)
    T: tokens per chunk
    N: number of chunks
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from distill.model.data import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    build_chunks,
    load_documents,
    split_documents,
)
from distill.model.tiny_recipe import (
    EOS_TOKEN,
    MASK_PROB,
    MASK_TOKEN,
    METRICS_FILE,
    PAD_TOKEN,
    TinyBertRecipe,
    TinyRecipe,
    special_tokens,
)

log = logging.getLogger(__name__)

_EVAL_CHUNKS = 64
"""Held-out chunks used to report loss before/after (enough for a stable estimate)."""

_LOG_EVERY_STEPS = 50


def build_teacher(recipe: TinyRecipe, out_dir: str) -> None:
    """Train tokenizer and model, save both and the metrics into `out_dir`."""
    start_s = time.perf_counter()
    docs = load_documents("pydoc")
    train_docs, _ = split_documents(docs, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)
    tokenizer = train_tokenizer(train_docs, recipe.vocab_size, recipe.seq_len)
    chunks = build_chunks(
        tokenizer, docs, recipe.seq_len, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED,
        max_heldout_chunks=_EVAL_CHUNKS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(_model_config(recipe, tokenizer))
        metrics = _pretrain(model, chunks.train_NT, chunks.heldout_NT, recipe)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metrics.update(recipe=asdict(recipe), build_s=time.perf_counter() - start_s, pid=os.getpid())
    with open(os.path.join(out_dir, METRICS_FILE), "w") as f:
        json.dump(metrics, f, indent=2)


def train_tokenizer(
    docs: list[str], vocab_size: int, seq_len: int, mask: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style: any text encodes, nothing is <unk>) trained on `docs`;
    with `mask`, it also has `MASK_TOKEN` (for masked-LM pre-training)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens(mask)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(docs, trainer)
    extra = {"mask_token": MASK_TOKEN} if mask else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=seq_len, **extra,
    )


def _model_config(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A Llama of the recipe's size; the MLP is ~8/3 * hidden as in Llama, tied embeddings."""
    intermediate_size = 16 * math.ceil(8 * recipe.hidden_size / 3 / 16)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# ---------------------------------------------------------------------- pre-training


def _pretrain(
    model: LlamaForCausalLM, train_NT: torch.Tensor, heldout_NT: torch.Tensor, recipe: TinyRecipe
) -> dict:
    """AdamW with warmup + cosine decay on random train chunks; held-out loss before/after."""
    loss_before = heldout_loss(model, heldout_NT)
    log.info(
        "pre-training tiny teacher: %d steps x %d chunks of %d tokens, %d threads; "
        "held-out loss %.3f (ppl %.1f) before",
        recipe.train_steps, recipe.batch_size, recipe.seq_len, torch.get_num_threads(),
        loss_before, math.exp(loss_before),
    )
    train_s, train_cpu_s = _train_loop(model, train_NT, recipe, lambda batch_BT: _lm_loss(model, batch_BT),
                                       betas=(0.9, 0.95), weight_decay=0.1, what="train loss")
    loss_after = heldout_loss(model, heldout_NT)
    log.info("held-out loss %.3f (ppl %.1f) after %.1f s of pre-training",
             loss_after, math.exp(loss_after), train_s)
    return {
        "heldout_loss_before": loss_before,
        "heldout_loss_after": loss_after,
        "heldout_ppl_before": math.exp(loss_before),
        "heldout_ppl_after": math.exp(loss_after),
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
        "num_train_chunks": len(train_NT),
        "num_heldout_chunks": len(heldout_NT),
    }


def _train_loop(model: torch.nn.Module, train_NT: torch.Tensor, recipe: TinyRecipe | TinyBertRecipe,
                loss_of: Callable[[torch.Tensor], torch.Tensor], *, betas: tuple[float, float],
                weight_decay: float, what: str) -> tuple[float, float]:
    """AdamW with warmup + cosine decay over ``recipe.train_steps`` random train batches, the
    one loop both tiny teachers pre-train with (they differ in their loss and AdamW settings);
    leaves ``model`` in eval mode and returns the wall and CPU seconds it took."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=betas, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(recipe.train_steps))
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    model.train()
    bar = tqdm(total=recipe.train_steps, desc=f"pre-training the tiny {type(model).__name__}", unit="step",
               mininterval=1.0)
    with bar:
        for step, batch_BT in enumerate(_batches(train_NT, recipe), start=1):
            loss = loss_of(batch_BT)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            if step % _LOG_EVERY_STEPS == 0 or step == recipe.train_steps:
                bar.set_postfix_str(f"{what} {loss.item():.3f}", refresh=False)
                log.debug("step %d/%d %s %.3f (%.1f s)", step, recipe.train_steps, what,
                          loss.item(), time.perf_counter() - start_s)
    model.eval()
    return time.perf_counter() - start_s, time.process_time() - start_cpu_s


def _lr_lambda(total_steps: int):
    """Linear warmup over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup_steps = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _batches(train_NT: torch.Tensor, recipe: TinyRecipe) -> Iterator[torch.Tensor]:
    """`train_steps` batches drawn epoch by epoch from seeded permutations of the chunks."""
    generator = torch.Generator().manual_seed(recipe.seed)
    order = torch.empty(0, dtype=torch.int64)
    for _ in range(recipe.train_steps):
        while len(order) < recipe.batch_size:
            order = torch.cat([order, torch.randperm(len(train_NT), generator=generator)])
        idx, order = order[: recipe.batch_size], order[recipe.batch_size :]
        yield train_NT[idx]


def _lm_loss(model: LlamaForCausalLM, batch_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch."""
    logits_BTV = model(input_ids=batch_BT).logits
    return F.cross_entropy(
        logits_BTV[:, :-1].flatten(0, 1).float(), batch_BT[:, 1:].flatten()
    )


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, chunks_NT: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy of `model` over `chunks_NT` (nats per token)."""
    if len(chunks_NT) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(chunks_NT), batch_size):
        batch_BT = chunks_NT[start : start + batch_size]
        total += _lm_loss(model, batch_BT).item() * len(batch_BT)
    model.train(was_training)
    return total / len(chunks_NT)


# ---------------------------------------------------------------------- the tiny BERT


def build_bert(recipe: TinyBertRecipe, out_dir: str) -> None:
    """Tokenizer and masked-LM pre-training on the train split; saves the bare encoder."""
    start_s = time.perf_counter()
    docs = load_documents("pydoc")
    train_docs, _ = split_documents(docs, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)
    tokenizer = train_tokenizer(train_docs, recipe.vocab_size, recipe.seq_len, mask=True)
    chunks = build_chunks(
        tokenizer, docs, recipe.seq_len, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED,
        max_heldout_chunks=_EVAL_CHUNKS,
    )
    config = _bert_config(recipe, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        mlm = BertForMaskedLM(config)
        metrics = _pretrain_mlm(mlm, chunks.train_NT, chunks.heldout_NT, recipe, tokenizer.mask_token_id)
        torch.manual_seed(recipe.seed)
        encoder = BertModel(config)  # the pooler (which MLM does not train) from the seed
    encoder.load_state_dict(mlm.bert.state_dict(), strict=False)
    encoder.eval()
    metrics["identity_cosine"] = identity_cosine(encoder, chunks.heldout_NT)
    log.info("tiny BERT: held-out cosine of the teacher with every layer skipped %.3f",
             metrics["identity_cosine"])
    encoder.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metrics.update(recipe=asdict(recipe), build_s=time.perf_counter() - start_s, pid=os.getpid())
    with open(os.path.join(out_dir, METRICS_FILE), "w") as f:
        json.dump(metrics, f, indent=2)


def _bert_config(recipe: TinyBertRecipe, tokenizer: PreTrainedTokenizerFast) -> BertConfig:
    """A BERT of the recipe's size (MLP 4 x hidden, as in BERT), without dropout."""
    return BertConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        intermediate_size=4 * recipe.hidden_size, max_position_embeddings=recipe.seq_len,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )


def mask_tokens(
    batch_BT: torch.Tensor, mask_id: int, vocab_size: int, mask_prob: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs_BT, labels_BT) for masked-LM: each token is picked with `mask_prob`; a picked
    token becomes the mask (80%), a random token (10%) or stays (10%); labels are the
    original ids at picked positions and -100 (ignored) elsewhere."""
    picked_BT = torch.rand(batch_BT.shape, generator=generator) < mask_prob
    labels_BT = batch_BT.masked_fill(~picked_BT, -100)
    roll_BT = torch.rand(batch_BT.shape, generator=generator)
    random_BT = torch.randint(vocab_size, batch_BT.shape, generator=generator)
    inputs_BT = batch_BT.masked_fill(picked_BT & (roll_BT < 0.8), mask_id)
    swap_BT = picked_BT & (roll_BT >= 0.8) & (roll_BT < 0.9)
    inputs_BT = torch.where(swap_BT, random_BT, inputs_BT)
    return inputs_BT, labels_BT


def _pretrain_mlm(
    model: BertForMaskedLM, train_NT: torch.Tensor, heldout_NT: torch.Tensor,
    recipe: TinyBertRecipe, mask_id: int,
) -> dict:
    """AdamW with warmup + cosine decay on masked random train chunks; held-out MLM loss
    (with a fixed masking) before/after."""
    loss_before = heldout_mlm_loss(model, heldout_NT, mask_id, recipe.mask_prob)
    log.info("pre-training tiny BERT (masked LM): %d steps x %d chunks of %d tokens; held-out "
             "loss %.3f before", recipe.train_steps, recipe.batch_size, recipe.seq_len, loss_before)
    generator = torch.Generator().manual_seed(recipe.seed + 1)

    def masked_lm_loss(batch_BT: torch.Tensor) -> torch.Tensor:
        inputs_BT, labels_BT = mask_tokens(batch_BT, mask_id, model.config.vocab_size,
                                           recipe.mask_prob, generator)
        return model(input_ids=inputs_BT, labels=labels_BT).loss

    train_s, train_cpu_s = _train_loop(model, train_NT, recipe, masked_lm_loss,
                                       betas=(0.9, 0.98), weight_decay=0.01, what="masked-LM loss")
    loss_after = heldout_mlm_loss(model, heldout_NT, mask_id, recipe.mask_prob)
    log.info("held-out masked-LM loss %.3f after %.1f s of pre-training", loss_after, train_s)
    return {
        "heldout_mlm_loss_before": loss_before,
        "heldout_mlm_loss_after": loss_after,
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
        "num_train_chunks": len(train_NT),
        "num_heldout_chunks": len(heldout_NT),
    }


@torch.no_grad()
def heldout_mlm_loss(
    model: BertForMaskedLM, chunks_NT: torch.Tensor, mask_id: int, mask_prob: float = MASK_PROB,
    batch_size: int = 16,
) -> float:
    """Mean masked-LM cross-entropy over `chunks_NT`, with the same masking on every call."""
    if len(chunks_NT) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(0)
    total, count = 0.0, 0
    for start in range(0, len(chunks_NT), batch_size):
        inputs_BT, labels_BT = mask_tokens(chunks_NT[start : start + batch_size], mask_id,
                                           model.config.vocab_size, mask_prob, generator)
        picked = int((labels_BT != -100).sum())
        total += model(input_ids=inputs_BT, labels=labels_BT).loss.item() * picked
        count += picked
    model.train(was_training)
    return total / max(1, count)


@torch.no_grad()
def identity_cosine(encoder: BertModel, chunks_NT: torch.Tensor, batch_size: int = 16) -> float:
    """Mean per-token cosine between the encoder's final hidden state and its embeddings: the
    score of a student whose every layer is the identity (1.0 would mean the layers do nothing)."""
    total, count = 0.0, 0
    for start in range(0, len(chunks_NT), batch_size):
        batch_BT = chunks_NT[start : start + batch_size]
        final_BTD = encoder(input_ids=batch_BT).last_hidden_state
        embedded_BTD = encoder.embeddings(input_ids=batch_BT)
        total += F.cosine_similarity(final_BTD, embedded_BTD, dim=-1).sum().item()
        count += batch_BT.numel()
    return total / max(1, count)
