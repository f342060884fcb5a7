"""The generator + discriminator pair and the RTD step's math (arXiv 2111.09543 §3.1).

One forward computes, in order (STYLE rule 5):
  mask → generator forward → L_MLM at masked positions → sample replacements (no grad)
  → discriminator forward → L_RTD over non-pad tokens → L = L_MLM + rtd_lambda · L_RTD.
The caller (``training/``) runs backward and the optimizer step.

Under ``rtd.objective=mlm`` the model is the masked LM alone (``config.Objective``): one encoder of
the discriminator's shape in the generator's place, its MLM head tied to its own table, and the
step is mask → encoder forward → L_MLM (``masked_lm_head``): no sampling, no discriminator.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from rtd_scale.config import (DisentangledCore, LayerNormPosition, ModelConfig, Objective,
                              RTDConfig)
from megatron.core import parallel_state

from rtd_scale.model.embeddings import TiedOutputTable, TokenTable
from rtd_scale.model.sharing import embedding_pair, generator_embeddings
from rtd_scale.model import weights
from rtd_scale.model.encoder import Encoder, transformer_config
from rtd_scale.model.heads import (MLMCriterion, MLMHead, RTDCriterion, RTDHead,
                                   ReplacementSampler)
from rtd_scale.objectives.losses import (MLM_COUNT, RTD_COUNT, loss_counts,
                                         micro_batch_normaliser, replaced_labels,
                                         shuffled_labels, total_loss)
from rtd_scale.objectives.masking import (MaskedBatch, mask_tokens, masked_positions,
                                          prediction_budget)

# Keys of RTDOutput.counts, summed over tokens (reduced and divided only at log time).
COUNT_KEYS = ("masked", "mlm_correct", "tokens", "replaced", "rtd_correct_replaced",
              "original", "rtd_correct_original")


class RTDOutput(NamedTuple):
    """What one RTD forward returns (a NamedTuple, so DeepSpeed ZeRO-3 sees its tensors).

    loss: scalar, L_MLM + rtd_lambda · L_RTD (differentiable); L_MLM under
        ``rtd.objective=mlm``, where ``rtd_loss`` is 0, the RTD counts are 0, ``corrupted_ids``
        the input and ``rtd_logits`` None.
    mlm_loss: scalar, this micro-batch's summed CE over masked positions / its normaliser
        (``objectives/losses.py``: the global batch's masked positions / its micro-batches;
        without one, the micro-batch's mean); part of ``loss``'s graph.
    rtd_loss: scalar, likewise the summed BCE over non-pad tokens / its normaliser.
    counts: dict of scalar float tensors (see COUNT_KEYS), kept on the device.
    corrupted_ids: [b, s] the discriminator's input.
    masked: [b, s] bool, the masked positions.
    rtd_logits: [b, s] the discriminator's logits (detached; validation's AUC reads them).
    """

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    rtd_loss: torch.Tensor
    counts: dict[str, torch.Tensor]
    corrupted_ids: torch.Tensor
    masked: torch.Tensor
    rtd_logits: Optional[torch.Tensor] = None


class GeneratorResult(NamedTuple):
    """The generator's half of the step on one micro-batch (last pipeline stage).

    mlm_loss: scalar, differentiable; corrupted_ids: [b, s]; labels: [b, s] float;
    mlm_correct: [b · k] bool (k slots per sample, False in unused ones); masked: [b, s] bool.
    """

    mlm_loss: torch.Tensor
    corrupted_ids: torch.Tensor
    labels: torch.Tensor
    mlm_correct: torch.Tensor
    masked: torch.Tensor


class RTDModel(torch.nn.Module):
    """Generator (masked LM) and discriminator (replaced-token detector) with shared embeddings —
    or, under pipeline parallelism, this stage's share of both.

    Both models are split over the same pipeline ranks: the first stage (``pre_process``) holds
    both embedding tables, so ES and GDES need no cross-stage traffic; the last stage
    (``post_process``) holds both heads. When the two differ, the last stage's MLM output weight is
    a copy of the generator's table (``TiedOutputTable``), kept equal as in Megatron-LM: the
    embedding group all-reduces the two copies' gradients (``training/pipeline.py``).

    Args:
        model: the model section of the config.
        rtd: the objective section.
        tensor_model_parallel_size: TP size (the vocabulary is padded to 128 × TP).
        special_ids: ids never masked and never sampled ([PAD], [CLS], [SEP], [UNK], [MASK]).
        pad_id, mask_id: ids of [PAD] and [MASK].
        seed: run seed (the initial weights, masks and sampling noise are functions of it; the
            weights do not depend on the tensor- or pipeline-parallel sizes, see
            ``model/weights.py``).
        pre_process, post_process: whether this is the first / last pipeline stage.
        pipeline_dtype: dtype of activations between stages.
        recompute_activations: megatron-core full-layer activation recompute in both models.
        word_start_table: [vocab_size] bool, whether each id begins a word
            (``Tokenizer.word_start_table``); needed when ``rtd.mask_strategy`` is whole_word or
            span. Kept as a non-persistent buffer, so it moves with the model.
    """

    def __init__(self, model: ModelConfig, rtd: RTDConfig, *, tensor_model_parallel_size: int,
                 special_ids: Sequence[int], pad_id: int, mask_id: int, seed: int,
                 pipeline_model_parallel_size: int = 1, pre_process: bool = True,
                 post_process: bool = True, pipeline_dtype: torch.dtype = torch.float32,
                 recompute_activations: bool = False,
                 word_start_table: Sequence[bool] | torch.Tensor | None = None):
        super().__init__()
        self.masked_lm_only = rtd.objective is Objective.MLM
        if self.masked_lm_only:  # one encoder, the discriminator's shape, as the generator
            model = model.masked_lm()
        self.cfg, self.rtd_cfg = model, rtd
        self.special_ids, self.pad_id, self.mask_id, self.seed = tuple(special_ids), pad_id, mask_id, seed
        self.pre_process, self.post_process = pre_process, post_process
        self.register_buffer("word_start_table", None if word_start_table is None else
                             torch.as_tensor(word_start_table, dtype=torch.bool), persistent=False)
        self.padded_vocab_size = model.padded_vocab_size(tensor_model_parallel_size)
        std = model.init_method_std
        tc = dict(init_std=std, tensor_model_parallel_size=tensor_model_parallel_size,
                  pipeline_model_parallel_size=pipeline_model_parallel_size,
                  pipeline_dtype=pipeline_dtype, recompute_activations=recompute_activations)
        gen_tc = transformer_config(model.generator, model=model, **tc)
        disc_tc = transformer_config(model.discriminator, model=model, **tc)

        post_ln = model.layernorm_position is LayerNormPosition.POST
        gen_emb = disc_emb = None
        if pre_process and self.masked_lm_only:
            gen_emb = generator_embeddings(model, gen_tc, self.padded_vocab_size)
        elif pre_process:  # both embedding layers, shared per model.sharing / sharing_scope
            gen_emb, disc_emb = embedding_pair(model, gen_tc, disc_tc, self.padded_vocab_size)
        enc = dict(layernorm_position=model.layernorm_position,
                   attention_type=model.attention_type, position_buckets=model.position_buckets,
                   max_relative_positions=model.resolved_max_relative_positions(),
                   disentangled_core=(None if model.disentangled_core is DisentangledCore.AUTO
                                      else model.disentangled_core.value),
                   rotary_base=model.rotary_base, local_rotary_base=model.local_rotary_base,
                   norm_bias=model.norm_bias, pre_process=pre_process, post_process=post_process)
        self.generator = Encoder(gen_emb, gen_tc, **enc)
        if not self.masked_lm_only:
            self.discriminator = Encoder(disc_emb, disc_tc, **enc)
        if post_process:
            output_table = (gen_emb.table if pre_process else
                            TiedOutputTable(self.padded_vocab_size, model.embedding_size, gen_tc))
            self.mlm_head = MLMHead(model.generator.hidden_size, output_table, model.vocab_size,
                                    model.generator.layernorm_epsilon, std)
            self.mlm_criterion = MLMCriterion(output_table)
            if not self.masked_lm_only:
                self.sampler = ReplacementSampler(output_table, model.vocab_size,
                                                  self.special_ids, seed=seed,
                                                  temperature=rtd.temperature,
                                                  disallow_correct=rtd.disallow_correct)
                self.rtd_head = RTDHead(model.discriminator.hidden_size, std)
                self.rtd_criterion = RTDCriterion()
        weights.initialize(self, seed=seed, std=std,
                           tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                           tp_size=tensor_model_parallel_size, vocab_size=model.vocab_size,
                           num_layers={"generator": model.generator.num_layers,
                                       "discriminator": model.discriminator.num_layers},
                           scaled_output={"generator": not post_ln, "discriminator": not post_ln})
        if model.compile_layers:  # in place: module names and weights stay as they are
            for encoder in self.encoders():
                for layer in encoder.block.layers:
                    layer.compile()

    def encoders(self) -> list[Encoder]:
        """This stage's encoders: the generator and the discriminator, or under
        ``rtd.objective=mlm`` the one encoder."""
        return [self.generator] + ([] if self.masked_lm_only else [self.discriminator])

    # The tables, by role (tests and the embedding-similarity metric read these; first stage).
    @property
    def generator_table(self) -> TokenTable:
        return self.generator.embeddings.table

    @property
    def discriminator_table(self) -> torch.nn.Module:
        return self.discriminator.embeddings.table

    def tied_parameters(self) -> list[torch.nn.Parameter]:
        """This stage's copies of the generator's table that the embedding group keeps equal:
        the input table on the first stage, the MLM output weight on the last (one object when
        both are here)."""
        out = []
        if self.pre_process:
            out.append(self.generator_table.weight)
        if self.post_process and not self.pre_process:
            out.append(self.mlm_head.table.weight)
        return out

    def pipeline_replicated_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters every pipeline stage holds a copy of — both encoders' relative tables and
        their norms (disentangled attention) — whose gradients the pipeline group sums."""
        return [p for e in self.encoders() for p in e.pipeline_replicated_parameters()]

    def foreign_parameters(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """(module, parameter) pairs where a module reads a parameter it does not own — the tied
        MLM output and the GDES base tables (token and position). DeepSpeed ZeRO-3 must gather
        them for that module."""
        pairs = []
        if self.post_process and self.pre_process:
            pairs += [(self.mlm_head, p) for p in self.mlm_head.foreign_parameters()]
        if self.pre_process and not self.masked_lm_only:
            pairs += self.discriminator.embeddings.foreign_parameters()
        return pairs

    # --- the step, in pieces shared by the single-stage forward and the pipeline schedule ---

    def mask(self, input_ids: torch.Tensor, sample_index: torch.Tensor) -> MaskedBatch:
        """Step 1: masked positions and the generator's input (``objectives/masking.py``), a
        function of (seed, sample index). The step calls it once per micro-batch: its counts
        normalise the global batch (``training/normalise.py``) and it goes to the forward."""
        rtd = self.rtd_cfg
        return mask_tokens(input_ids, sample_index, seed=self.seed, mask_prob=rtd.mask_prob,
                           mask_token_prob=rtd.mask_token_prob,
                           random_token_prob=rtd.random_token_prob, mask_id=self.mask_id,
                           vocab_size=self.cfg.vocab_size, special_ids=self.special_ids,
                           strategy=rtd.mask_strategy, word_start_table=self.word_start_table,
                           span_geometric_p=rtd.span_geometric_p,
                           span_max_words=rtd.span_max_words)

    def loss_counts(self, input_ids: torch.Tensor, sample_index: torch.Tensor,
                    masks: Optional[MaskedBatch] = None) -> torch.Tensor:
        """What the losses of micro-batch (``input_ids`` [b, s], ``sample_index`` [b]) are
        summed over: [2] int64 (masked positions, non-pad tokens), indexed by
        ``objectives.losses.MLM_COUNT`` / ``RTD_COUNT``. The masks are a function of (seed,
        sample index), so the step knows its global batch's counts before any forward
        (``training/normalise.py``); ``masks``: the micro-batch's, when the caller has them
        (else masked here as the forward would). On the ids' device, no host sync."""
        masks = masks if masks is not None else self.mask(input_ids, sample_index)
        return loss_counts(masks.masked, input_ids != self.pad_id)

    def generator_head(self, gen_hidden: torch.Tensor, input_ids: torch.Tensor,
                       sample_index: torch.Tensor, masked: torch.Tensor,
                       step: int, normaliser: Optional[torch.Tensor] = None) -> GeneratorResult:
        """Steps 2–4 on the last stage: MLM logits at masked positions only, L_MLM, replacements
        sampled from softmax(logits / T) (never argmax, no gradient), the discriminator's input
        and its labels (a correct sample counts as original, ELECTRA arXiv 2003.10555 §2;
        tests/unit/test_objectives.py::test_correct_sample_is_labelled_original).

        Args:
            gen_hidden: [s, b, Hg] the generator's final hidden states.
            input_ids: [b, s]; sample_index: [b]; masked: [b, s] bool.
            normaliser: [2] fp32 (``micro_batch_normaliser``) or None (this micro-batch alone).
        """
        rtd = self.rtd_cfg
        logits, targets, positions, valid, rows, cols = self._masked_logits(gen_hidden, input_ids,
                                                                            masked)
        b, k = positions.shape
        sampled = self.sampler(logits, step, sample_index[rows], cols, targets)  # [n]
        filled = torch.zeros_like(input_ids).scatter_add_(
            1, positions, torch.where(valid, sampled, 0).view(b, k))
        corrupted = torch.where(masked, filled, input_ids)
        labels = replaced_labels(corrupted, input_ids)
        if rtd.shuffle_labels and self.training:  # the negative control; validation
            labels = shuffled_labels(labels, input_ids != self.pad_id, seed=self.seed,
                                     step=step, sample_index=sample_index)  # scores the truth
        l_mlm, mlm_correct = self.mlm_criterion(  # after sampling: it consumes the logits
            logits, targets, valid, None if normaliser is None else normaliser[MLM_COUNT])
        return GeneratorResult(l_mlm, corrupted, labels, mlm_correct, masked)

    def _masked_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                       masked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The MLM head at the masked positions, in static shapes (no host sync): every
        sample's masked positions in k slots (k = the masking's per-sample maximum), unused
        slots marked invalid and given no weight. Returns logits [n = b·k, V_local], targets [n],
        positions [b, k], valid [n], rows [n], cols [n] (hidden is [s, b, H])."""
        b, s = input_ids.shape
        k = prediction_budget(self.rtd_cfg.mask_prob, s, self.rtd_cfg.mask_strategy)
        positions, valid = masked_positions(masked, k)  # [b, k] each
        rows = torch.arange(b, device=input_ids.device).view(b, 1).expand(b, k).reshape(-1)
        cols, valid = positions.view(-1), valid.view(-1)  # [n = b·k]
        logits = self.mlm_head(hidden[cols, rows])  # [n, V_local]
        return logits, input_ids[rows, cols], positions, valid, rows, cols

    def masked_lm_head(self, hidden: torch.Tensor, input_ids: torch.Tensor, masked: torch.Tensor,
                       pad: torch.Tensor, normaliser: Optional[torch.Tensor] = None) -> RTDOutput:
        """The step's end under ``rtd.objective=mlm`` (last stage): L_MLM at the masked
        positions (static shapes, as ``generator_head``), the loss itself; no sampling.

        Args:
            hidden: [s, b, H] the encoder's final hidden states; input_ids, masked, pad: [b, s].
            normaliser: [2] fp32 (``micro_batch_normaliser``) or None (this micro-batch alone).
        """
        logits, targets, _, valid, _, _ = self._masked_logits(hidden, input_ids, masked)
        l_mlm, mlm_correct = self.mlm_criterion(
            logits, targets, valid, None if normaliser is None else normaliser[MLM_COUNT])
        with torch.no_grad():
            zero = l_mlm.new_zeros(())
            counts = {key: zero.float() for key in COUNT_KEYS}
            counts.update(masked=masked.sum().float(), mlm_correct=mlm_correct.sum().float(),
                          tokens=(~pad).sum().float())
        return RTDOutput(loss=l_mlm, mlm_loss=l_mlm, rtd_loss=zero.detach(), counts=counts,
                         corrupted_ids=input_ids, masked=masked)

    def discriminator_head(self, disc_hidden: torch.Tensor, gen: GeneratorResult,
                           pad: torch.Tensor,
                           normaliser: Optional[torch.Tensor] = None) -> RTDOutput:
        """Step 5 on the last stage: BCE over every non-pad token, the weighted total, counts.

        Args:
            disc_hidden: [s, b, Hd] the discriminator's final hidden states; pad: [b, s] bool.
            normaliser: [2] fp32 (``micro_batch_normaliser``) or None (this micro-batch alone).
        """
        valid = ~pad
        disc_logits = self.rtd_head(disc_hidden)  # [b, s]
        l_rtd = self.rtd_criterion(disc_logits, gen.labels, valid,
                                   None if normaliser is None else normaliser[RTD_COUNT])
        loss = total_loss(gen.mlm_loss, l_rtd, self.rtd_cfg.rtd_lambda)
        with torch.no_grad():
            predicted = disc_logits.float() > 0
            is_rep = (gen.labels > 0) & valid
            is_orig = (gen.labels == 0) & valid
            counts = {
                "masked": gen.masked.sum().float(),
                "mlm_correct": gen.mlm_correct.sum().float(),
                "tokens": valid.sum().float(),
                "replaced": is_rep.sum().float(),
                "rtd_correct_replaced": (predicted & is_rep).sum().float(),
                "original": is_orig.sum().float(),
                "rtd_correct_original": (~predicted & is_orig).sum().float(),
            }
        return RTDOutput(loss=loss, mlm_loss=gen.mlm_loss, rtd_loss=l_rtd, counts=counts,
                         corrupted_ids=gen.corrupted_ids, masked=gen.masked,
                         rtd_logits=disc_logits.detach())

    def forward(self, input_ids: torch.Tensor, sample_index: torch.Tensor,
                step: int = 0, has_padding: bool = True,
                global_counts: Optional[torch.Tensor] = None,
                num_micro_batches: int = 1,
                masks: Optional[MaskedBatch] = None,
                document_ids: Optional[torch.Tensor] = None) -> RTDOutput:
        """One RTD forward on a micro-batch (single pipeline stage; see
        ``training/pipeline.py`` for the pipelined step).

        Args:
            input_ids: [b, s] int64 original ids ([PAD] where a sample is shorter).
            sample_index: [b] int64 global sample index (masks and noise are keyed by it).
            step: optimizer step (part of the sampling-noise key).
            has_padding: False when the caller knows that ``input_ids`` holds no [PAD] (packed
                samples; decided on the host, no device sync): attention then runs without a
                mask, which lets SDPA pick its flash kernels. True is always correct.
            global_counts: [2] int64, the global batch's (masked positions, non-pad tokens)
                summed over all its micro-batches and data-parallel ranks
                (``training/normalise.py``), or None: this micro-batch is the global batch.
                Integer, so that DeepSpeed's fp16 input cast leaves it exact.
            num_micro_batches: micro-batches in the global batch (accumulation × DP size).
            masks: step 1's result for this micro-batch (``mask``), computed once by the step,
                which also counted them for ``global_counts``; None: masked here.
            document_ids: [b, s] under document-masked packing (``MicroBatch.document_ids``):
                both encoders attend within each document and restart absolute positions at
                each (``model/document_mask.py``); None: attention across the whole sample.

        The step's phase timers (``training/timers.py``) time the submodules' calls from
        outside: the generator and its MLM head, the sampler, the discriminator and its head.
        """
        norm = (None if global_counts is None
                else micro_batch_normaliser(global_counts, num_micro_batches))
        pad = input_ids == self.pad_id  # [b, s]
        attn_pad = pad if has_padding else None
        m = masks if masks is not None else self.mask(input_ids, sample_index)  # 1. mask
        gen_hidden = self.generator(m.generator_input, attn_pad,
                                    document_ids)  # 2. generator  [s, b, Hg]
        if self.masked_lm_only:  # rtd.objective=mlm: L_MLM is the loss
            return self.masked_lm_head(gen_hidden, input_ids, m.masked, pad, norm)
        gen = self.generator_head(gen_hidden, input_ids, sample_index, m.masked, step,
                                  norm)  # 3–4. MLM head and L_MLM, sample (no grad)
        disc_hidden = self.discriminator(gen.corrupted_ids, attn_pad,
                                         document_ids)  # 5. discriminator
        return self.discriminator_head(disc_hidden, gen, pad, norm)  # 6. L_MLM + λ·L_RTD
