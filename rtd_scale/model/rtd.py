"""The generator + discriminator pair and the RTD step's math (arXiv 2111.09543 §3.1).

One forward computes, in order (STYLE rule 5):
  mask → generator forward → L_MLM at masked positions → sample replacements (no grad)
  → discriminator forward → L_RTD over non-pad tokens → L = L_MLM + rtd_lambda · L_RTD.
The caller (``training/``) runs backward and the optimizer step.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from rtd_scale.config import ModelConfig, RTDConfig, Sharing
from rtd_scale.model.embeddings import EncoderEmbeddings, TokenTable, discriminator_table
from rtd_scale.model import weights
from rtd_scale.model.encoder import Encoder, transformer_config
from rtd_scale.model.heads import MLMHead, RTDHead, mlm_loss, vocab_parallel_top1_correct
from rtd_scale.objectives.losses import replaced_labels, rtd_loss, total_loss
from rtd_scale.objectives.masking import mask_tokens
from rtd_scale.objectives.sampling import sample_from_logits

# Keys of RTDOutput.counts, summed over tokens (reduced and divided only at log time).
COUNT_KEYS = ("masked", "mlm_correct", "tokens", "replaced", "rtd_correct_replaced",
              "original", "rtd_correct_original")


class RTDOutput(NamedTuple):
    """What one RTD forward returns (a NamedTuple, so DeepSpeed ZeRO-3 sees its tensors).

    loss: scalar, L_MLM + rtd_lambda · L_RTD (differentiable).
    mlm_loss: scalar, mean CE over masked positions (part of ``loss``'s graph).
    rtd_loss: scalar, mean BCE over non-pad tokens (part of ``loss``'s graph).
    counts: dict of scalar float tensors (see COUNT_KEYS), kept on the device.
    corrupted_ids: [b, s] the discriminator's input.
    masked: [b, s] bool, the masked positions.
    """

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    rtd_loss: torch.Tensor
    counts: dict[str, torch.Tensor]
    corrupted_ids: torch.Tensor
    masked: torch.Tensor


class RTDModel(torch.nn.Module):
    """Generator (masked LM) and discriminator (replaced-token detector) with shared embeddings.

    Args:
        model: the model section of the config.
        rtd: the objective section.
        tensor_model_parallel_size: TP size (the vocabulary is padded to 128 × TP).
        special_ids: ids never masked and never sampled ([PAD], [CLS], [SEP], [UNK], [MASK]).
        pad_id, mask_id: ids of [PAD] and [MASK].
        seed: run seed (the initial weights, masks and sampling noise are functions of it; the
            weights do not depend on the tensor-parallel size, see ``model/weights.py``).
    """

    def __init__(self, model: ModelConfig, rtd: RTDConfig, *, tensor_model_parallel_size: int,
                 special_ids: Sequence[int], pad_id: int, mask_id: int, seed: int):
        super().__init__()
        self.cfg, self.rtd_cfg = model, rtd
        self.special_ids, self.pad_id, self.mask_id, self.seed = tuple(special_ids), pad_id, mask_id, seed
        self.padded_vocab_size = model.padded_vocab_size(tensor_model_parallel_size)
        std = model.init_method_std
        gen_tc = transformer_config(model.generator, init_std=std,
                                    tensor_model_parallel_size=tensor_model_parallel_size)
        disc_tc = transformer_config(model.discriminator, init_std=std,
                                     tensor_model_parallel_size=tensor_model_parallel_size)

        gen_table = TokenTable(self.padded_vocab_size, model.embedding_size, gen_tc)
        disc_table = discriminator_table(model.sharing, gen_table, self.padded_vocab_size,
                                         model.embedding_size, disc_tc)
        self.generator = Encoder(
            EncoderEmbeddings(gen_table, model.generator, model.embedding_size,
                              model.max_position_embeddings, std), gen_tc)
        self.mlm_head = MLMHead(model.generator.hidden_size, gen_table, model.vocab_size,
                                model.generator.layernorm_epsilon, std)
        self.discriminator = Encoder(
            EncoderEmbeddings(disc_table, model.discriminator, model.embedding_size,
                              model.max_position_embeddings, std), disc_tc)
        self.rtd_head = RTDHead(model.discriminator.hidden_size, std)

        v0, v1 = gen_table.vocab_start_index, gen_table.vocab_end_index
        sampleable = torch.arange(v0, v1) < model.vocab_size
        for sid in self.special_ids:
            if v0 <= sid < v1:
                sampleable[sid - v0] = False
        self.register_buffer("sampleable", sampleable, persistent=False)
        weights.initialize(self, seed=seed, std=std, tp_rank=gen_table.tp_group.rank(),
                           tp_size=tensor_model_parallel_size, vocab_size=model.vocab_size,
                           num_layers={"generator": model.generator.num_layers,
                                       "discriminator": model.discriminator.num_layers})

    # The tables, by role (tests and the embedding-similarity metric read these).
    @property
    def generator_table(self) -> TokenTable:
        return self.generator.embeddings.table

    @property
    def discriminator_table(self) -> torch.nn.Module:
        return self.discriminator.embeddings.table

    def foreign_parameters(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """(module, parameter) pairs where a module reads a parameter it does not own — the tied
        MLM output and the GDES base table. DeepSpeed ZeRO-3 must gather them for that module."""
        pairs = [(self.mlm_head, p) for p in self.mlm_head.foreign_parameters()]
        table = self.discriminator_table
        if hasattr(table, "foreign_parameters"):
            pairs += [(table, p) for p in table.foreign_parameters()]
        return pairs

    def forward(self, input_ids: torch.Tensor, sample_index: torch.Tensor,
                step: int = 0) -> RTDOutput:
        """One RTD forward on a micro-batch.

        Args:
            input_ids: [b, s] int64 original ids ([PAD] where a sample is shorter).
            sample_index: [b] int64 global sample index (masks and noise are keyed by it).
            step: optimizer step (part of the sampling-noise key).
        """
        rtd = self.rtd_cfg
        pad = input_ids == self.pad_id  # [b, s]
        valid = ~pad

        # 1. mask (a pure function of seed, sample index, position)
        m = mask_tokens(input_ids, sample_index, seed=self.seed, mask_prob=rtd.mask_prob,
                        mask_token_prob=rtd.mask_token_prob,
                        random_token_prob=rtd.random_token_prob, mask_id=self.mask_id,
                        vocab_size=self.cfg.vocab_size, special_ids=self.special_ids)

        # 2. generator forward; MLM logits at masked positions only
        gen_hidden = self.generator(m.generator_input, pad)  # [s, b, Hg]
        rows, cols = torch.nonzero(m.masked, as_tuple=True)  # n masked positions (b, s) order
        logits = self.mlm_head(gen_hidden[cols, rows])  # [n, V_local]
        targets = input_ids[rows, cols]  # [n]

        # 3. sample replacements from softmax(logits / T), never argmax; no gradient
        sampled = sample_from_logits(
            logits.detach(), seed=self.seed, step=step, sample_index=sample_index[rows],
            position=cols, vocab_start=self.generator_table.vocab_start_index,
            sampleable=self.sampleable, temperature=rtd.temperature,
            disallow_ids=targets if rtd.disallow_correct else None,
            tp_group=self.generator_table.tp_group)
        mlm_correct = vocab_parallel_top1_correct(
            logits, targets, self.generator_table.vocab_start_index, self.generator_table.tp_group)
        l_mlm = mlm_loss(logits, targets)  # consumes logits

        # 4. discriminator input and labels: a correct sample counts as original (C01)
        corrupted = input_ids.clone()
        corrupted[rows, cols] = sampled
        labels = replaced_labels(corrupted, input_ids)  # [b, s]

        # 5. discriminator forward; BCE over every non-pad token
        disc_logits = self.rtd_head(self.discriminator(corrupted, pad))  # [b, s]
        l_rtd = rtd_loss(disc_logits, labels, valid)
        loss = total_loss(l_mlm, l_rtd, rtd.rtd_lambda)

        with torch.no_grad():
            predicted = disc_logits.float() > 0
            is_rep = (labels > 0) & valid
            is_orig = (labels == 0) & valid
            counts = {
                "masked": m.masked.sum().float(),
                "mlm_correct": mlm_correct.sum().float(),
                "tokens": valid.sum().float(),
                "replaced": is_rep.sum().float(),
                "rtd_correct_replaced": (predicted & is_rep).sum().float(),
                "original": is_orig.sum().float(),
                "rtd_correct_original": (~predicted & is_orig).sum().float(),
            }
        return RTDOutput(loss=loss, mlm_loss=l_mlm, rtd_loss=l_rtd,
                         counts=counts, corrupted_ids=corrupted, masked=m.masked)
