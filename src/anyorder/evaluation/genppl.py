"""Generative perplexity and unigram entropy of samples (METHOD.md sections 4-5).

A *judge* causal LM scores the model's samples: ``gpt2-large`` by default, any local
``transformers`` model folder, or one of our own ``gpt`` checkpoints (its exact
left-to-right NLL). Generative perplexity is always reported beside the samples' unigram
entropy: a sampler can buy a low perplexity with repetitive text, and the entropy shows it.

Two protocols (:data:`PROTOCOLS`); every table names the one behind its figures.

``ours`` (METHOD.md section 5, the SEDD/MDLM convention):

* Samples are decoded to text with the model's tokenizer and re-tokenized with the
  judge's. A sample is cut at its first EOS; when it had one, the judge's EOS is appended,
  so the NLL runs up to and including the first EOS.
* Our choice: the judge's BOS (GPT-2's ``<|endoftext|>``; our ``gpt``'s learned BOS) is
  given as context, so the first token is scored too; peers drop the first token instead
  (one token in a 1024-token sample). Text longer than the judge's context is cut to it
  and counted in ``truncated``.
* Generative perplexity is ``exp(total NLL / total scored tokens)`` over all samples.

``reference`` (the AO-GPT reference code, ``sample_AOGPT.py``, behind its Table 2):

* Every generated id is scored as it is: no cut at EOS, no re-tokenization (so the judge
  must share the model's vocabulary; :func:`same_vocabulary`), no BOS: tokens ``2..n``
  each from the ids before it.
* Generative perplexity is the *mean of per-sample perplexities*, ``mean_i exp(mean NLL
  of sample i)``; by Jensen it is at least ``exp`` of the pooled mean. Any-order samples
  put EOS at random places, so ``ours`` drops arbitrary suffixes and the two differ. Its
  spread is ``np.std`` of them (ddof 0), as the reference prints it.
* Samples are drawn with the reference's top-p (``top_p_sampling_from_probs``: the token
  whose cumulative mass crosses ``p`` is dropped, where the usual nucleus keeps it).

Both:
* Unigram entropy (nats) is computed per sample over the sample's own token ids (all ``n``
  of them, as generated), then averaged over samples.
* :func:`generate_samples` is the one place that picks a sampler:
  :func:`anyorder.sampling.sample` (sequential with a KV cache at ``steps = n``, Lemma 1
  with ``steps < n``; the encoder's ancestral sampler for ``mdm``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from anyorder.data.untrusted import refuse_custom_code
from anyorder.errors import CheckpointError, ConfigError, DataError, SamplingError

DEFAULT_JUDGE = "gpt2-large"

PROTOCOLS = {
    "ours": "exp(pooled mean judge NLL), each sample cut at its first EOS, re-tokenized, "
    "after the judge's BOS",
    "reference": "mean of per-sample exp(mean judge NLL) over every generated id as it is, "
    "the first token as context (AO-GPT's sample_AOGPT.py)",
}
"""Generative perplexity protocols: what each computes."""

# ----------------------------------------------------------------------------- samples


@torch.no_grad()
def generate_samples(
    model: Any,
    n: int,
    num: int,
    mode: str = "random",
    steps: int | None = None,
    temperature: float = 1.0,
    top_p: float | None = None,
    seed: int = 0,
    *,
    batch_size: int = 16,
    progress: bool = True,
    top_p_rule: str = "nucleus",
) -> Tensor:
    """``num`` unconditional samples of ``n`` tokens: (num, n) token ids.

    Args:
        model: any model of :mod:`anyorder.models` (``gpt`` decodes left to right).
        n: tokens per sample.
        num: number of samples.
        mode: the generation order, ``random`` or ``l2r``.
        steps: decoding steps (None: ``n``, one token per step).
        temperature, top_p: sampling controls.
        seed: seeds the generator of batch ``i`` with ``seed + i``.
        batch_size: samples per sampler call.
        progress: a tqdm bar over the batches.
        top_p_rule: ``nucleus`` or ``reference`` (the AO-GPT code's top-p, which drops the
            token that crosses ``p``; :func:`anyorder.sampling.draws.top_p_rule`).

    Raises:
        SamplingError: bad controls, ``steps`` outside ``1..n``, or ``steps < n`` for gpt.
    """
    from tqdm.auto import tqdm

    from anyorder.sampling import samplers
    from anyorder.sampling.draws import top_p_rule as rule_in_force

    steps = n if steps is None else steps
    if not 1 <= steps <= n:
        raise SamplingError(f"steps={steps} must lie in 1..n={n}")
    if mode not in ("random", "l2r"):
        raise SamplingError(f"order mode {mode!r}: use random or l2r")
    if model.kind == "gpt":
        mode = "l2r"
    out = []
    batches = range(0, num, batch_size)
    for i, start in enumerate(tqdm(batches, desc="samples", disable=None if progress else True)):
        b = min(batch_size, num - start)
        gen = torch.Generator(model.device).manual_seed(seed + i)
        with rule_in_force(top_p_rule):
            out.append(_sample_batch(samplers, model, n, b, mode, steps, temperature, top_p, gen))
    return torch.cat(out).cpu()


def _sample_batch(samplers, model, n, b, mode, steps, temperature, top_p, gen) -> Tensor:
    # the fast samplers: sequential with a KV cache at steps = n, Lemma 1 below (the
    # encoder: a full pass per step); naive_sample stays the oracle they are tested against
    out = samplers.sample(
        model, n, order=mode, steps=None if steps == n else steps, batch=b,
        temperature=temperature, top_p=top_p, generator=gen,
    )  # fmt: skip
    return out.tokens


def unigram_entropy(samples: Tensor) -> Tensor:
    """Entropy in nats of each sample's empirical unigram distribution: (num, n) -> (num,)."""
    out = []
    for row in samples:
        counts = torch.bincount(row.long()).double()
        p = counts[counts > 0] / row.numel()
        out.append(-(p * p.log()).sum())
    return torch.stack(out)


# ----------------------------------------------------------------------------- judges


class HFJudge:
    """A ``transformers`` causal LM and its tokenizer (hub id or local folder)."""

    def __init__(self, name_or_path: str, device: torch.device | str = "cpu") -> None:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise ConfigError(
                "a transformers judge needs transformers; pip install anyorder[hf]"
            ) from None
        self.name = name_or_path
        if Path(name_or_path).expanduser().is_dir():  # untrusted: refuse code it asks to run
            try:
                refuse_custom_code(Path(name_or_path).expanduser())
            except DataError as e:
                raise CheckpointError(f"judge {name_or_path!r}: {e}") from None
        model = tok = None
        errors = []
        for local_only in (True, False):  # the local cache answers at once, the hub retries
            try:
                # never run (nor ask to run) the judge's own code, a hub judge's included
                tok = AutoTokenizer.from_pretrained(
                    name_or_path, local_files_only=local_only, trust_remote_code=False
                )
                model = AutoModelForCausalLM.from_pretrained(
                    name_or_path, local_files_only=local_only, trust_remote_code=False
                )
                break
            except Exception as e:
                errors.append(str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
        if model is None or tok is None:
            raise CheckpointError(
                f"judge {name_or_path!r} could not be loaded from a folder, the cache or the hub "
                f"({errors[-1]}); pass --judge with a local model folder"
            )
        self.tok = tok
        self.model = model.to(device).eval()
        self.eos_id = tok.eos_token_id
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        cfg = model.config
        self.max_len = int(  # an anyorder export's config calls its context seq_len
            getattr(cfg, "n_positions", None)
            or getattr(cfg, "max_position_embeddings", None)
            or getattr(cfg, "seq_len", None)
            or 1024
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], *, bos: bool = True) -> tuple[Tensor, Tensor]:
        """Summed NLL (nats) and scored-token count per sequence, each token from the BOS and
        the tokens before it (``bos=False``: no BOS, the first token is context only)."""
        dev = self.model.device
        ids = [[self.bos_id, *s] if bos else list(s) for s in seqs]
        T = max(len(s) for s in ids)
        x = torch.zeros(len(ids), T, dtype=torch.long, device=dev)
        att = torch.zeros_like(x)
        for i, s in enumerate(ids):
            x[i, : len(s)] = torch.tensor(s, device=dev)
            att[i, : len(s)] = 1
        logits = self.model(input_ids=x, attention_mask=att).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        mask = att[:, 1:].float()
        return (nll * mask).sum(1).double().cpu(), mask.sum(1).cpu()


class ModelJudge:
    """One of our left-to-right ``gpt`` checkpoints as a judge (its exact NLL)."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu") -> None:
        from anyorder.checkpoint import load_model

        loaded = load_model(path, weights="ema", device=device)
        if loaded.model.kind != "gpt":
            raise ConfigError(
                f"judge checkpoint {str(path)!r} is a {loaded.model.kind} model; a judge must be "
                "a left-to-right gpt (or a transformers causal LM)"
            )
        self.name = str(loaded.path)
        self.model = loaded.model
        self.tok = loaded.tokenizer
        self.eos_id = self.tok.eos_id
        self.max_len = self.model.cfg.seq_len + 1  # + the learned BOS, which is not a token
        self.max_ids = self.model.cfg.seq_len  # ids that fit, the BOS aside

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    @property
    def vocab_size(self) -> int:
        return int(self.tok.vocab_size)

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], *, bos: bool = True) -> tuple[Tensor, Tensor]:
        """Summed NLL and token count per sequence; right padding leaves a causal model's
        earlier slots unchanged. ``bos=False``: the first token is context only (our gpt
        always reads its learned BOS, so it stays in the context)."""
        T = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), T, dtype=torch.long, device=self.model.device)
        mask = torch.zeros(len(seqs), T)
        for i, s in enumerate(seqs):
            x[i, : len(s)] = torch.tensor(list(s), device=x.device)
            mask[i, : len(s)] = 1
        if not bos:
            mask[:, 0] = 0
        nll = self.model.token_nll(x).cpu()
        return (nll * mask).sum(1).double(), mask.sum(1)


def load_judge(spec: str, device: torch.device | str = "cpu") -> HFJudge | ModelJudge:
    """Our checkpoint (a run or checkpoint folder) or a ``transformers`` causal LM."""
    from anyorder.checkpoint import is_checkpoint, latest_checkpoint

    p = Path(spec).expanduser()
    if p.is_dir() and (is_checkpoint(p) or latest_checkpoint(p) is not None):
        return ModelJudge(p, device)
    return HFJudge(spec, device)


# ----------------------------------------------------------------------------- the metric


@dataclass
class GenScore:
    """Generative perplexity and entropy of a set of samples."""

    gen_ppl: float
    """Under ``protocol``: pooled (ours) or the mean of per-sample perplexities (reference)."""
    nll_per_token: float
    """Pooled mean judge NLL per scored token (either protocol)."""
    entropy: float
    """Mean per-sample unigram entropy, nats."""
    entropy_std: float
    samples: int
    scored_tokens: int
    with_eos: int
    """Samples that contain an EOS (scored up to and including the first)."""
    truncated: int
    """Samples whose re-tokenized text was cut to the judge's context."""
    protocol: str = "ours"
    ppl_per_sample_std: float | None = None
    """Standard deviation of the per-sample perplexities (reference protocol)."""
    ppl_per_sample: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def same_vocabulary(tokenizer: Any, judge: Any) -> bool:
    """Whether the judge reads the model's ids as they are: the same vocabulary size, EOS
    and encoding of a probe text."""
    probe = "Hello world, the 1990s: 3.5 km of café-text.\n  x = [1, 2]"
    try:
        return (
            int(getattr(judge, "vocab_size", -1)) == int(tokenizer.vocab_size)
            and judge.eos_id == tokenizer.eos_id
            and list(judge.encode(probe)) == list(tokenizer.encode(probe))
        )
    except Exception:
        return False


def judge_inputs(samples: Tensor, tokenizer: Any, judge: Any) -> tuple[list[list[int]], int, int]:
    """Decode each sample up to its first EOS, re-tokenize with the judge, append the judge's
    EOS where the sample had one, cut to the judge's context.

    Returns:
        (judge token lists, samples with an EOS, samples truncated)
    """
    eos = tokenizer.eos_id
    seqs, with_eos, truncated = [], 0, 0
    room = judge.max_len - 1  # one place for the BOS
    for row in samples.tolist():
        cut = row.index(eos) if eos in row else len(row)
        ids = judge.encode(tokenizer.decode(row[:cut]))
        if cut < len(row):
            ids.append(judge.eos_id)
            with_eos += 1
        if len(ids) > room:
            ids, truncated = ids[:room], truncated + 1
        seqs.append(ids or [judge.eos_id])  # an empty sample is scored as a lone EOS
    return seqs, with_eos, truncated


def generative_perplexity(
    samples: Tensor, tokenizer: Any, judge: Any, *, batch_size: int = 8, protocol: str = "ours"
) -> GenScore:
    """Score ``samples`` (num, n) of our model with ``judge`` under ``protocol`` (``ours`` or
    ``reference``, see the module docstring).

    Raises:
        ConfigError: an unknown protocol, or ``reference`` with a judge whose vocabulary is
            not the model's (it scores the ids as they are).
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    eos = tokenizer.eos_id
    with_eos = sum(eos in row for row in samples.tolist())
    truncated = 0
    if protocol == "reference":
        if not same_vocabulary(tokenizer, judge):
            raise ConfigError(
                f"the reference protocol scores the generated ids as they are, and the judge "
                f"{judge.name!r} has another vocabulary than the model's tokenizer; use a judge "
                "with the model's tokenizer, or --protocol ours"
            )
        room = getattr(judge, "max_ids", judge.max_len)  # no BOS: the whole context is ids
        seqs = [row[:room] for row in samples.tolist()]
        truncated = sum(len(r) > room for r in samples.tolist())
    else:
        seqs, with_eos, truncated = judge_inputs(samples, tokenizer, judge)
    nlls, counts = [], []
    for i in range(0, len(seqs), batch_size):
        nll, cnt = judge.score(seqs[i : i + batch_size], bos=protocol == "ours")
        nlls.append(nll.double())
        counts.append(cnt.double())
    nll, cnt = torch.cat(nlls), torch.cat(counts)
    ent = unigram_entropy(samples)
    mean = float(nll.sum() / cnt.sum().clamp(min=1.0))
    per_sample = (nll / cnt.clamp(min=1.0)).exp()
    reference = protocol == "reference"
    return GenScore(
        gen_ppl=float(per_sample.mean()) if reference else math.exp(mean),
        nll_per_token=mean,
        entropy=float(ent.mean()),
        entropy_std=float(ent.std()) if len(ent) > 1 else 0.0,
        samples=len(seqs),
        scored_tokens=int(cnt.sum()),
        with_eos=with_eos,
        truncated=truncated,
        protocol=protocol,
        # np.std, as the reference prints it: the population deviation (ddof 0)
        ppl_per_sample_std=float(per_sample.std(correction=0)) if reference else None,
        ppl_per_sample=[round(float(p), 4) for p in per_sample] if reference else None,
    )


def gen_sweep(
    model: Any,
    tokenizer: Any,
    judge: Any,
    *,
    n: int,
    num: int,
    steps: Sequence[int | None] = (None,),
    temperatures: Sequence[float] = (1.0,),
    top_p: float | None = None,
    mode: str = "random",
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = True,
    protocol: str = "ours",
) -> list[dict[str, Any]]:
    """Generative perplexity (under ``protocol``) and entropy for every (steps, temperature)
    pair.

    Returns:
        One dict per pair: the settings, :class:`GenScore` fields and one sample's text.
    """
    rows = []
    for st in steps:
        for temp in temperatures:
            s = generate_samples(
                model, n, num, mode, st, temp, top_p, seed, batch_size=batch_size,
                progress=progress, top_p_rule="reference" if protocol == "reference" else "nucleus",
            )  # fmt: skip
            score = generative_perplexity(
                s, tokenizer, judge, batch_size=batch_size, protocol=protocol
            )
            rows.append(
                {"steps": st or n, "temperature": temp, "top_p": top_p, "mode": mode, "n": n}
                | score.as_dict()
                | {"example": tokenizer.decode(s[0].tolist())[:500]}
            )
            if progress:
                print(
                    f"steps {st or n:5d}  T {temp:.2f}  gen-ppl {score.gen_ppl:9.3f}  "
                    f"entropy {score.entropy:.3f}",
                    flush=True,
                )
    return rows


def gen_markdown(rows: Sequence[dict[str, Any]], judge: str) -> str:
    """The sweep as a Markdown table, its protocol named in the header and under it."""
    protocol = rows[0].get("protocol", "ours") if rows else "ours"
    what = "pooled" if protocol == "ours" else "mean per sample"
    head = (
        f"| steps | temperature | top-p | gen PPL ({protocol} protocol: {what}) | "
        "entropy (nats) | samples | with EOS |\n|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        spread = r.get("ppl_per_sample_std")
        ppl = f"{r['gen_ppl']:.3f}" + (f" (std {spread:.3f})" if spread is not None else "")
        body += (
            f"| {r['steps']} | {r['temperature']:g} | {r['top_p'] if r['top_p'] else 1:g} | "
            f"{ppl} | {r['entropy']:.3f} ± {r['entropy_std']:.3f} | {r['samples']} | "
            f"{r['with_eos']} |\n"
        )
    return head + body + f"\nJudge: {judge}. Protocol {protocol}: {PROTOCOLS[protocol]}.\n"
