"""Load an export the way a fine-tuning user does and write what it computes; run as a script by
the interpreter of the transformers major under test (it imports neither rtd_scale nor tests).

    python hf_load_worker.py EXPORT_DIR SPEC_JSON OUT_PT

SPEC_JSON: {"texts": [...], "discriminator": [class name, from_pretrained kwargs],
"generator": [class name, kwargs], "tokenizer_texts": [...]}; without "discriminator" (a
directory that holds only a tokenizer) the models are left out. "masked_lm": [class name, kwargs,
directory] adds an ``rtd.objective=mlm`` export (one model at that directory), run on the same
batch.

Writes, with ``torch.save``: the versions, the tokenizer's class, its ids for each text alone and
for the first two as a pair, the loading info of each model, and in fp32 each model's last
base model's last hidden state (plus ``logits`` where the class has them) on the padded batch of all texts
(truncated at the recorded ``model_max_length``); where the export has ``spm.model``,
``slow_ids``: the ids of the export's ``DebertaV2Tokenizer`` (on 4.x the slow SentencePiece
class, on 5.x the class that rebuilds its normaliser) for texts + tokenizer_texts, and
``fast_ids``: AutoTokenizer's for the same texts.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import torch  # noqa: E402
import transformers  # noqa: E402


@torch.no_grad()
def run(model, batch):
    """``last_hidden_state`` of the class's base model (with RoBERTa-PreLayerNorm's final
    LayerNorm; ``hidden_states[-1]`` holds it in 5.x, not in 4.x) and the class's ``logits``."""
    result = {"hidden": model.base_model(**batch).last_hidden_state.float()}
    logits = getattr(model(**batch), "logits", None)
    if logits is not None:
        result["logits"] = logits.float()
    return result


def main(export, spec_json, out_path):
    with open(spec_json, encoding="utf-8") as f:
        spec = json.load(f)
    texts = spec["texts"]
    tok = transformers.AutoTokenizer.from_pretrained(export)
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "tokenizer_class": type(tok).__name__,
              "ids": [tok(t)["input_ids"] for t in texts],
              "pair_ids": tok(texts[0], texts[1])["input_ids"]}
    if "discriminator" in spec:
        batch = tok(texts, padding=True, truncation=True, return_tensors="pt")  # model_max_length
        result["input_names"] = sorted(batch)
        batch.pop("token_type_ids", None)  # one token type; 4.x returns it, 5.x does not
        result["attention_mask"] = batch["attention_mask"]
        roles = [("discriminator", export), ("generator", os.path.join(export, "generator"))]
        if "masked_lm" in spec:
            roles.append(("masked_lm", spec["masked_lm"][2]))
        for role, where in roles:
            cls_name, kwargs = spec[role][:2]
            model, info = getattr(transformers, cls_name).from_pretrained(
                where, output_loading_info=True, **kwargs)
            result[f"{role}_loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
            result[role] = run(model.eval(), batch)
    if os.path.isfile(os.path.join(export, "spm.model")):
        more = texts + spec.get("tokenizer_texts", [])
        slow = transformers.DebertaV2Tokenizer.from_pretrained(export)
        result["slow_ids"] = [slow(t)["input_ids"] for t in more]
        result["fast_ids"] = [tok(t)["input_ids"] for t in more]
    torch.save(result, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
