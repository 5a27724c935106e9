"""TRL: run ``GRPOTrainer`` on an rlkernels-patched policy with the fused log-prob path.

One import::

    from rlkernels.integrations.trainers.trl import RLKGRPOTrainer      # instead of trl.GRPOTrainer
    trainer = RLKGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(...), ...)

or, on a trainer built already, ``patch_grpo_trainer(trainer)``.

Where it hooks in (TRL >= 1.16, the version this is tested with): every per-token
log-prob of ``GRPOTrainer`` -- the "old" ones taken right after generation, the
training forward's, the reference model's -- comes from
``GRPOTrainer._get_per_token_logps_and_entropies``, which calls
``model(input_ids, attention_mask, labels=labels, fused_lm_head=True)`` on a forward
that ``trl.trainer.utils.add_fused_lm_head`` installed. This module replaces that
fused path of the forward (the plain path, which ``generate`` uses, is TRL's,
untouched) by the rlkernels one: the decoder runs under the batch-invariant mode, and
the next-token log-probs and entropies are :func:`rlkernels.linear_logprob` on the
final hidden states, so no [tokens, vocab] logits are materialised and a token's
log-prob is the same bits whatever the batch chunk, the rows beside it, or grad mode.
Replacing the forward (rather than the trainer method) keeps DDP/FSDP/accelerate
wrappers in the call path, and TRL's own chunking (``batch_size``), label building
(``-100`` outside the completion, ``logits_to_keep``) and slicing stay as they are.

Conventions kept from TRL: ``labels`` are the input ids with ``-100`` where not
scored; the log-prob at position t scores ``labels[:, t+1]`` (``shift_labels``
pre-shifted ones are scored at t); ignored positions give 0 log-prob and 0 entropy;
logits are divided by the trainer's ``temperature``; the output is TRL's
``FusedCausalLMOutput`` (``loss``, ``log_probs``, ``entropy``, ``label_mask``).
One deliberate difference: position ids are recomputed from the attention mask
(left padding starts each sequence at position 0, as in generation), where stock TRL
numbers the padded columns too; RoPE makes the two the same function of the tokens,
and the mask's positions are what makes a sequence's log-probs independent of its
padding.

With ``top_k``/``top_p`` the rollout draws each completion token from the truncated
distribution and returns its kept set's threshold; the thresholds travel with the
completions through TRL's batches (``logit_thresholds`` beside ``completion_ids``) into
every scoring, so the trainer's log-probs are the truncated distribution's, the
sampler's bits.

Not covered (refused with an error naming the argument): multimodal inputs, MoE
router outputs, ``cast_lm_head_to_fp32`` (unneeded: the fused head's logits are fp32
already), PEFT adapters on the LM head.
"""
from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..hf.coverage import decoder_of, mode_for
from ..hf.patch import patch_model
from ..hf.scoring import IGNORE_INDEX, check_head, hidden_states
from ...ops.linear_logprob import linear_logprob
from ...ops.lm_head.truncation import validate_truncation

try:
    import trl
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('rlkernels.integrations.trainers.trl needs TRL: pip install "rlkernels[trl]"') from exc

OP = "integrations.trainers.trl"
_TESTED = "1.16"


def _fused_output_type() -> type:
    """TRL's FusedCausalLMOutput, or an error naming the TRL version that lacks it."""
    try:
        from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"rlkernels.{OP}: TRL {trl.__version__} has no fused LM head (trl.trainer.utils.add_fused_lm_head / "
            f"FusedCausalLMOutput), the hook this integration replaces; use TRL >= {_TESTED}") from exc
    return FusedCausalLMOutput


def _check_trainer(trainer: Any) -> None:
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"rlkernels.{OP}.patch_grpo_trainer: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    if not callable(getattr(trainer, "_get_per_token_logps_and_entropies", None)):
        raise RuntimeError(
            f"rlkernels.{OP}: TRL {trl.__version__}'s GRPOTrainer has no _get_per_token_logps_and_entropies, the "
            f"per-token log-prob method this integration is built on (tested with TRL {_TESTED})")
    if getattr(trainer.args, "cast_lm_head_to_fp32", False):
        raise ValueError(f"rlkernels.{OP}: cast_lm_head_to_fp32=True is not supported (and not needed: "
                         "linear_logprob keeps the logits in fp32); set it to False")


def _fused_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, temperature: float,
                    num_items_in_batch: Any, completion_thresholds: torch.Tensor | None = None) -> Any:
    """TRL's fused-head output, computed by rlkernels: log_probs / entropy [B, L-1] fp32 (or [B, L] pre-shifted).

    ``completion_thresholds`` [B, C] fp32: the kept-set thresholds of the last C scored
    positions (the completion's tokens; -inf: nothing left out), under which the log-probs
    and entropies are those of the truncated distribution the rollout drew from."""
    if input_ids is None or input_ids.dim() != 2:
        shape = None if input_ids is None else tuple(input_ids.shape)
        raise ValueError(f"rlkernels.{OP}: the fused log-prob forward needs input_ids [B, L], got {shape}")
    if (labels is None) == (shift_labels is None):
        raise ValueError(f"rlkernels.{OP}: pass exactly one of labels / shift_labels to the fused log-prob forward")
    # The head and the model's transform of its logits (Gemma's final soft-cap), or a refusal.
    head, transform = check_head(OP, model)
    with mode_for(model):
        hidden = hidden_states(model, input_ids, attention_mask)
        if shift_labels is None:
            hidden, target = hidden[:, :-1], labels[:, 1:]
        else:
            target = shift_labels
        target = target.to(hidden.device)
        mask = target != IGNORE_INDEX
        threshold = None
        if completion_thresholds is not None:
            threshold = torch.full(target.shape, -math.inf, dtype=torch.float32, device=hidden.device)
            width = completion_thresholds.shape[1]
            threshold[:, threshold.shape[1] - width:] = completion_thresholds.to(hidden.device)
            threshold = threshold[mask]
        # Only scored positions go through the head: rows are independent in linear_logprob,
        # so selecting them changes no bits and saves the prompt's share of the head.
        logp, ent = linear_logprob(hidden[mask], head.weight, target[mask], getattr(head, "bias", None),
                                   temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=True,
                                   logit_threshold=threshold, logit_scale=transform.scale,
                                   logit_softcap=transform.softcap)
    # masked_scatter keeps an all-ignored chunk connected to the graph (a zero with a gradient).
    log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    entropy = ent.new_zeros(mask.shape).masked_scatter(mask, ent)
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return _fused_output_type()(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=entropy,
                                label_mask=mask)


class _Thresholds:
    """The kept-set thresholds of the rows TRL is scoring, handed to the fused forward chunk
    by chunk: ``rows`` [B, C] fp32 for a batch of B sequences whose last C scored positions
    are its completions, ``taken`` the rows the forward's calls have consumed so far (TRL
    scores a batch in consecutive chunks of rows, in order)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.taken = 0

    def next_chunk(self, batch: int) -> torch.Tensor | None:
        if self.rows is None:
            return None
        if self.taken + batch > self.rows.shape[0]:
            raise RuntimeError(f"rlkernels.{OP}: the fused log-prob forward was called on more rows than the "
                               f"{self.rows.shape[0]} completions whose kept sets it holds")
        chunk = self.rows[self.taken:self.taken + batch]
        self.taken += batch
        return chunk


def _install_forward(model: nn.Module, temperature: float) -> None:
    """Route ``model(..., fused_lm_head=True)`` to rlkernels; every other call to the forward it had."""
    previous = model.forward
    thresholds = model.__dict__.setdefault("_rlkernels_thresholds", _Thresholds())

    def forward(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        device = next(self.parameters()).device.type
        # TRL's bf16/fp16 flags run the model under accelerate's autocast, whose per-op casts
        # would hand the invariant ops mixed dtypes: the model computes in its parameters' dtype.
        with torch.autocast(device, enabled=False):
            if not fused_lm_head:
                extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                           ("num_items_in_batch", num_items_in_batch)) if v is not None}
                return previous(*args, **kwargs, **extra)
            input_ids = args[0] if args else kwargs.pop("input_ids", None)
            attention_mask = args[1] if len(args) > 1 else kwargs.pop("attention_mask", None)
            kwargs.pop("use_cache", None)
            unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
            if len(args) > 2 or unsupported:
                raise NotImplementedError(f"rlkernels.{OP}: the fused log-prob forward takes text inputs only "
                                          f"(input_ids, attention_mask, labels); got "
                                          f"{unsupported or 'extra positional arguments'}")
            chunk = thresholds.next_chunk(input_ids.shape[0]) if input_ids is not None else None
            return _fused_logprobs(self, input_ids, attention_mask, labels, shift_labels, temperature,
                                   num_items_in_batch, chunk)

    model.forward = types.MethodType(forward, model)


# GRPOConfig's sampling options the rollout does not take, and the value at which each
# leaves the distribution alone: anything else draws from a distribution whose log-probs the
# trainer does not score. (top_k and top_p are taken: the trainer scores their kept sets.)
_NEUTRAL_SAMPLING = {"min_p": (None, 0.0), "repetition_penalty": (1.0, None), "generation_kwargs": (None, {})}


def _truncation(trainer: Any) -> tuple[int, float]:
    """The trainer's (top_k, top_p), checked: 0 and 1.0 where off."""
    top_k = getattr(trainer.args, "top_k", None)
    top_k = 0 if top_k is None else top_k
    top_p = getattr(trainer.args, "top_p", 1.0)
    validate_truncation(OP, top_k, top_p)
    return int(top_k), float(top_p)


def _check_rollout_args(trainer: Any) -> None:
    for name, neutral in _NEUTRAL_SAMPLING.items():
        value = getattr(trainer.args, name, None)
        if value not in neutral:
            raise ValueError(f"rlkernels.{OP}: {name}={value!r} is not supported when completions come from "
                             f"rlkernels.rollout (it would draw from a distribution the trainer does not score); "
                             f"set it to {neutral[0]!r}, or pass rollout=False to keep TRL's own generation")
    if getattr(trainer, "use_vllm", False):
        raise ValueError(f"rlkernels.{OP}: use_vllm=True and rollout=True: completions come from one of them; "
                         "pass rollout=False to keep vLLM's")
    top_k, top_p = _truncation(trainer)
    if top_k > 0 or top_p < 1.0:
        beta = getattr(trainer.args, "beta", 0.0)
        if beta:
            raise ValueError(f"rlkernels.{OP}: top_k={top_k}, top_p={top_p} with beta={beta}: the KL term's "
                             "reference log-probs have no kept set (a threshold on the policy's logits says "
                             "nothing of the reference model's); set beta=0.0, or sample without top_k/top_p")
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError(f"rlkernels.{OP}: top_k={top_k}, top_p={top_p} with tools: a completion interleaved "
                             "with tool output has no one kept set per token from the rollout; sample without "
                             "top_k/top_p, or pass rollout=False")


def _generate_by_rollout(self: GRPOTrainer, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any,
                         num_generations: int, has_tool_images: bool = False) -> tuple[list[list[int]], None]:
    """``GRPOTrainer._generate_single_turn`` through :func:`rlkernels.rollout`: one sample per
    entry of ``prompt_ids`` (TRL repeats each prompt ``num_generations`` times already), at the
    trainer's temperature, up to ``max_completion_length`` tokens, ending at its EOS ids.

    A call's draws are keyed by a seed made from ``args.seed`` and the number of rollouts
    this trainer ran, and streams numbered per process, so every completion of a run has its
    own (seed, stream). Returns (completion ids, each with its EOS where one was drawn; None:
    TRL scores the old log-probs itself, the same bits)."""
    if images is not None or multimodal_fields:
        raise ValueError(f"rlkernels.{OP}: rollout generation takes text prompts only; pass rollout=False")
    from trl.models.utils import unwrap_model_for_generation

    from ..hf.continuous_batching import rollout

    calls = self.__dict__.get("_rlkernels_rollouts", 0)
    self._rlkernels_rollouts = calls + 1
    seed = (int(self.args.seed) * 1_000_003 + calls) % (1 << 62)
    first = self.accelerator.process_index * len(prompt_ids)
    with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                     gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                     gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                                     ) as unwrapped, torch.no_grad(), \
            self._dist.summon_full_params(self.model_wrapped, recurse=False):
        top_k, top_p = _truncation(self)
        samples = rollout(_base(unwrapped), prompt_ids, max_new_tokens=self.max_completion_length,
                          temperature=float(self.temperature), seed=seed,
                          streams=list(range(first, first + len(prompt_ids))), eos_token_id=list(self.eos_token_ids),
                          top_k=top_k, top_p=top_p)
    if samples and samples[0].thresholds is not None:
        # Each completion's kept sets, for every scoring of this generation batch (old
        # log-probs here, the training forwards later): see _hand_on_thresholds.
        self._rlkernels_kept = [s.thresholds for s in samples]
    return [s.tokens.tolist() for s in samples], None


def _padded(kept: list[torch.Tensor] | torch.Tensor, width: int) -> torch.Tensor:
    """Completions' thresholds as [B, width] fp32, -inf past each one's end (TRL's right padding)."""
    rows = kept if isinstance(kept, torch.Tensor) else pad_sequence(kept, batch_first=True, padding_value=-math.inf)
    if rows.shape[1] > width:
        raise RuntimeError(f"rlkernels.{OP}: the batch's completions are {width} wide, their kept sets "
                           f"{rows.shape[1]}")
    return F.pad(rows, (0, width - rows.shape[1]), value=-math.inf)


def _hand_on_thresholds(trainer: GRPOTrainer, holder: _Thresholds) -> None:
    """Carry a truncated rollout's kept sets to every scoring of its completions.

    The rollout leaves each completion's thresholds on the trainer (``_rlkernels_kept``).
    ``_generate_and_score_completions`` then scores the old log-probs under them and adds
    them to its output as ``logit_thresholds`` [B, C], which TRL shuffles and splits with
    the other per-completion tensors; ``_compute_loss`` takes its micro-batch's. Each
    scoring (``_get_per_token_logps_and_entropies``) hands them to the fused forward
    through ``holder``, chunk by chunk, and checks that every row took its own."""
    generate_and_score = trainer._generate_and_score_completions
    compute_loss = trainer._compute_loss
    logps = trainer._get_per_token_logps_and_entropies

    def _generate_and_score_completions(inputs: Any) -> Any:
        trainer._rlkernels_kept = None
        try:
            output = generate_and_score(inputs)
            if trainer._rlkernels_kept is not None:
                output["logit_thresholds"] = _padded(trainer._rlkernels_kept, output["completion_ids"].shape[1])
            return output
        finally:
            trainer._rlkernels_kept = None

    def _compute_loss(model: Any, inputs: Any) -> Any:
        trainer._rlkernels_kept = inputs.get("logit_thresholds")
        try:
            return compute_loss(model, inputs)
        finally:
            trainer._rlkernels_kept = None

    def _get_per_token_logps_and_entropies(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
        kept = trainer.__dict__.get("_rlkernels_kept")
        if kept is None:
            return logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        rows = _padded(kept, logits_to_keep)
        if rows.shape[0] != input_ids.shape[0]:
            raise RuntimeError(f"rlkernels.{OP}: {input_ids.shape[0]} sequences to score, and kept sets for "
                               f"{rows.shape[0]} completions")
        holder.rows, holder.taken = rows, 0
        try:
            out = logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if holder.taken != rows.shape[0]:
                raise RuntimeError(f"rlkernels.{OP}: the fused log-prob forward scored {holder.taken} of the "
                                   f"{rows.shape[0]} completions whose kept sets it was handed")
            return out
        finally:
            holder.rows, holder.taken = None, 0

    trainer._generate_and_score_completions = _generate_and_score_completions
    trainer._compute_loss = _compute_loss
    trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies


def _base(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # PEFT: the patched forward lives on the base model
    return get_base() if callable(get_base) else model


def patch_grpo_trainer(trainer: GRPOTrainer, *, rollout: bool = True) -> GRPOTrainer:
    """Make ``trainer``'s per-token log-probs rlkernels' fused, batch-invariant ones and, with
    ``rollout``, its completions :func:`rlkernels.rollout`'s; in place, returns it.

    Patches the policy (and the reference model, if any) with
    :func:`rlkernels.patch_model` (Linear, RMSNorm, the invariant attention; parameters
    shared, so an optimizer already built is unaffected) and routes the fused
    log-prob forward that ``GRPOTrainer._get_per_token_logps_and_entropies`` calls to
    :func:`rlkernels.linear_logprob` at ``trainer.temperature``. With ``rollout`` (the
    default), TRL's generation (``_generate_single_turn``) becomes continuous batching
    through :func:`rlkernels.rollout` (:func:`_generate_by_rollout`): every completion is
    drawn from the distribution the trainer scores, and is what its prompt alone gives.
    With ``top_k``/``top_p`` in the config, the rollout draws from the truncated
    distribution and each completion's kept sets go to every scoring of it
    (:func:`_hand_on_thresholds`): the old log-probs and the training forward's are that
    distribution's, bitwise the sampler's.
    ``rollout=False`` keeps TRL's generation (transformers' ``generate``, or vLLM).
    Call it before training starts. Raises RuntimeError for a TRL without that method or
    without its fused LM head, ValueError for ``cast_lm_head_to_fp32=True`` and, with
    ``rollout``, for a sampling option other than its neutral value (``min_p``,
    ``repetition_penalty``, ``generation_kwargs``), ``use_vllm``, and ``top_k``/``top_p``
    with ``beta`` > 0 (the reference model's log-probs have no kept set) or with tools.
    """
    _check_trainer(trainer)
    _fused_output_type()
    if rollout:
        _check_rollout_args(trainer)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        base = _base(model)
        if decoder_of(base) is base:
            raise TypeError(f"rlkernels.{OP}: {type(base).__name__} has no base decoder (expected a *ForCausalLM)")
        patch_model(base)
        _install_forward(base, float(trainer.temperature))
    if rollout:
        trainer._generate_single_turn = types.MethodType(_generate_by_rollout, trainer)
        _hand_on_thresholds(trainer, _base(trainer.model).__dict__["_rlkernels_thresholds"])
    return trainer


class RLKGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs are rlkernels' and whose completions come
    from :func:`rlkernels.rollout` (``rollout=False``: TRL's own generation); see
    :func:`patch_grpo_trainer`."""

    def __init__(self, *args: Any, rollout: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        patch_grpo_trainer(self, rollout=rollout)
