"""Bring your own tokenizer: special pieces found by name, DeBERTaV3's appended [MASK],
tokenizer.json / vocab.txt through the tokenizers library, one-line refusals, and
Tokenizer.save_pretrained giving a Hugging Face tokenizer that encodes like the pipeline."""
from __future__ import annotations

import json
import pickle
import random

import pytest

from rtd_scale.data import normalize_text as normmod
from rtd_scale.data import tokenizer as tokmod
from rtd_scale.data.normalize_text import normalize_text
from rtd_scale.data.tokenizer import (
    SpecialIds,
    Tokenizer,
    TokenizerModelError,
)
from tests.helpers import byo_tokenizers as byo

LAYOUTS = ("ours", "deberta_v3", "default_layout_extended", "roberta_names", "wordpiece_vocab", "wordpiece_json")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """layout -> the file to pass as --tokenizer-model."""
    return byo.every_layout(tmp_path_factory.mktemp("byo"))


# -- special ids --------------------------------------------------------------------------------


def test_special_ids_of_each_layout(tokenizers):
    ours = Tokenizer(tokenizers["ours"])
    assert ours.specials == SpecialIds(pad=0, cls=1, sep=2, unk=3, mask=4)
    assert ours.special_ids == (0, 1, 2, 3, 4) and ours.vocab_size == 600 and ours.applies_normalize_text

    deberta = Tokenizer(tokenizers["deberta_v3"])
    assert [deberta.id_to_piece(i) for i in range(4)] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    assert deberta.specials == SpecialIds(pad=0, cls=1, sep=2, unk=3, mask=600)  # appended after 600 pieces
    assert deberta.appended_mask and deberta.vocab_size == 601
    assert deberta.id_to_piece(600) == "[MASK]" and deberta.piece_to_id("[MASK]") == 600
    assert not deberta.applies_normalize_text  # nmt_nfkc is its own normaliser

    extended = Tokenizer(tokenizers["default_layout_extended"])
    assert extended.specials == SpecialIds(pad=600, cls=1, sep=2, unk=0, mask=601)
    assert extended.special_pieces == {"pad": "<pad>", "cls": "<s>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"}
    assert extended.vocab_size == 602

    roberta = Tokenizer(tokenizers["roberta_names"])
    assert roberta.specials == SpecialIds(pad=1, cls=0, sep=2, unk=3, mask=4)

    for name in ("wordpiece_vocab", "wordpiece_json"):
        wp = Tokenizer(tokenizers[name])
        assert wp.specials == SpecialIds(pad=0, cls=2, sep=3, unk=1, mask=4), name
        assert wp.vocab_size == 800 and not wp.applies_normalize_text


def test_add_special_pieces_keeps_every_id(tokenizers):
    import sentencepiece as spm

    before = spm.SentencePieceProcessor(model_file=tokenizers["default_layout"])
    after = Tokenizer(tokenizers["default_layout_extended"])
    for text in byo.wiki_texts(20):
        assert after.encode(text) == before.encode(text)
    assert [after.id_to_piece(i) for i in (600, 601)] == ["<pad>", "<mask>"]
    assert not {600, 601} & {i for t in byo.wiki_texts(60) for i in after.encode(t)}


def test_encoding_never_yields_pad_or_mask_on_real_text(tokenizers):
    for name in LAYOUTS:
        tok = Tokenizer(tokenizers[name])
        ids = {i for t in byo.wiki_texts(30) for i in tok.encode(t)}
        assert ids and not {tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id} & ids, name
        assert max(ids) < tok.vocab_size
        assert tok.encode_batch(byo.wiki_texts(5)) == [tok.encode(t) for t in byo.wiki_texts(5)]


def test_tokenizer_json_without_a_normaliser_gets_normalize_text(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, "[MASK]": 4, "a": 5,
                                       "b": 6, "é": 7}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "tokenizer.json")
    assert tok.applies_normalize_text and tok.specials == SpecialIds(pad=0, cls=1, sep=2, unk=3, mask=4)
    # zero-width space dropped, e + combining acute composed to é (NFC): ids 5, 7, 6
    assert tok.encode("a\u200b  e\u0301\tb") == [5, 7, 6]
    assert hf.encode("a\u200b  e\u0301\tb").ids == [3, 3, 6]  # without our rule
    tok.save_pretrained(tmp_path / "hf")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("a\u200b  e\u0301\tb")["input_ids"] == [1, 5, 7, 6, 2]


def test_foreign_tokenizers_pickle(tokenizers):
    for name in ("deberta_v3", "wordpiece_vocab", "wordpiece_json"):
        tok = Tokenizer(tokenizers[name])
        clone = pickle.loads(pickle.dumps(tok))
        text = byo.wiki_texts(1)[0]
        assert clone.encode(text) == tok.encode(text) and clone.specials == tok.specials
        assert clone.sha256 == tok.sha256 == tokmod.file_sha256(tokenizers[name])


def test_vocab_txt_case_follows_the_vocabulary(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join([*byo.BERT_SPECIALS, "the", "river", "##s"]) + "\n")
    uncased = Tokenizer(tmp_path / "vocab.txt")
    assert uncased.encode("The Rivers") == [5, 6, 7]
    (tmp_path / "cased").mkdir()
    (tmp_path / "cased" / "vocab.txt").write_text("\n".join([*byo.BERT_SPECIALS, "The", "the", "river"]) + "\n")
    cased = Tokenizer(tmp_path / "cased" / "vocab.txt")
    assert cased.encode("The the river") == [5, 6, 7]
    assert cased.encode("THE") == [cased.unk_id]


def test_vocab_txt_gives_the_ids_of_transformers_bert_tokenizer(tokenizers, tmp_path):
    """The vocab.txt reader builds BERT's WordPiece itself (the ``tokenizers`` library alone, no
    transformers import in every preprocessing worker and rank; the case read from the
    vocabulary, which transformers takes from a tokenizer_config.json a bare vocab.txt lacks):
    its ids are transformers' ``BertTokenizer``'s on real text, the normalisation texts and
    literal special pieces, uncased and cased. The control: the other case setting differs."""
    from transformers import BertTokenizer

    texts = [*byo.wiki_texts(40), *byo.normalisation_texts(), "[MASK] and [CLS] x, [SEP]",
             "Na\u00efve CAF\u00c9 \u6771\u4eac \u00adsoft", "a" * 150]
    path = tokenizers["wordpiece_vocab"]
    vocab = dict((t, i) for i, t in enumerate(open(path, encoding="utf-8").read().splitlines()))
    ours, bert = Tokenizer(path), BertTokenizer(vocab=vocab, do_lower_case=True)
    for text in texts:
        assert ours.encode(text) == bert(text, add_special_tokens=False)["input_ids"], text[:80]
    cased_vocab = [*byo.BERT_SPECIALS, "The", "the", "River", "river", "##s", "caf", "##\u00e9", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(cased_vocab) + "\n", encoding="utf-8")
    cased = Tokenizer(tmp_path / "vocab.txt")
    vocab = {t: i for i, t in enumerate(cased_vocab)}
    as_cased = BertTokenizer(vocab=vocab, do_lower_case=False)
    for text in ("The river Rivers the.", "THE caf\u00e9 River", "the Caf\u00e9 rivers"):
        assert cased.encode(text) == as_cased(text, add_special_tokens=False)["input_ids"], text
    lowered = BertTokenizer(vocab=vocab, do_lower_case=True)
    assert cased.encode("The River") != lowered("The River", add_special_tokens=False)["input_ids"]


# -- refusals: one line naming the missing piece and the fix ------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and isinstance(exc.value, ValueError)
    return msg


def test_default_layout_names_both_missing_pieces_and_the_tool(tokenizers):
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(tokenizers["default_layout"])
    msg = _one_line(e)
    assert f"tokenizer {tokenizers['default_layout']} has no pad piece ([PAD] or <pad>) and no mask piece " \
           "([MASK] or <mask>)" in msg
    assert f"python tools/add_special_pieces.py --input {tokenizers['default_layout']} --output NEW.model" in msg


def test_sentencepiece_with_pad_but_no_mask_is_refused(tmp_path):
    # [PAD] 0 and <unk>, <s>, </s>: not DeBERTaV3's layout, so no [MASK] is appended.
    path = byo.train_spm(tmp_path, "pad_only", pad_id=3)
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(path)
    msg = _one_line(e)
    assert "has no mask piece ([MASK] or <mask>);" in msg and "no pad piece" not in msg


def test_vocab_txt_without_mask_and_json_without_pad(tmp_path):
    path = byo.wordpiece_vocab(tmp_path, specials=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[unused0]"])
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(path)
    assert f"has no mask piece ([MASK] or <mask>); append the line(s) [MASK] to {path}" in _one_line(e)

    from tokenizers import Tokenizer as HFTokenizer, models

    json_path = tmp_path / "tokenizer.json"
    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3, "a": 4}, unk_token="[UNK]"))
    hf.save(str(json_path))
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(json_path)
    msg = _one_line(e)
    assert "has no pad piece ([PAD] or <pad>); add them with the tokenizers library" in msg
    assert "add_special_tokens(['[PAD]'])" in msg


def test_unreadable_files_are_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(tmp_path / "tokenizer.json")
    assert "is not a Hugging Face tokenizer.json" in _one_line(e)
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(tmp_path)
    assert f"--tokenizer-model {tmp_path} is a directory; pass the file inside it" in _one_line(e)


# -- Hugging Face -------------------------------------------------------------------------------


def test_normalize_text_as_a_hf_normalizer_agrees():
    hf = normmod.normalize_text_hf_normalizer()
    rng = random.Random(0)
    pool = [*range(0, 0x80), 0x85, 0xA0, 0xAD, 0x200B, 0x200D, 0x2028, 0x3000, 0xFEFF, 0x301, 0x308,
            0xE9, 0x1100, 0x1161, 0x11A8, 0x180E, 0xE0020, 0x1F600, 0x2060, 0x1C, 0x1F, 0x1680, 0x202F]
    for _ in range(3000):
        s = "".join(chr(rng.choice(pool)) for _ in range(rng.randint(0, 12)))
        assert hf.normalize_str(s) == normalize_text(s), repr(s)
    for text in byo.wiki_texts(20):
        assert hf.normalize_str(text) == normalize_text(text)


def test_normalize_text_as_a_sentencepiece_charsmap_agrees():
    """The character map a SentencePiece model applies (then collapsing and stripping spaces),
    against normalize_text: on the fuzz pool above with U+0000 left out (the one character a
    SentencePiece map cannot hold), letters and combining marks apart from the dropped
    characters (a mark after a dropped one is not composed: normalize_text_charsmap's
    docstring), and on the NFC and NFD forms of real and accented text."""
    import unicodedata

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    spec = sentencepiece_model_pb2.NormalizerSpec(
        name=normmod.NORMALIZE_TEXT_RULE_NAME, precompiled_charsmap=normmod.normalize_text_charsmap(),
        add_dummy_prefix=False, remove_extra_whitespaces=True, escape_whitespaces=False)
    sp = spm.SentencePieceNormalizer(normalizer_spec=spec)
    rng = random.Random(0)
    controls = [*range(1, 0x80), 0x85, 0xA0, 0xAD, 0x200B, 0x200D, 0x2028, 0x3000, 0xFEFF, 0xE9,
                0x180E, 0xE0020, 0x1F600, 0x2060, 0x1C, 0x1F, 0x1680, 0x202F,
                0x212B, 0x2126, 0x0958, 0xF900]  # singletons and a composition exclusion
    marks = [*range(0x41, 0x5B), *range(0x61, 0x7B), 0x20, 0x0A, 0x3000, 0xE9, 0x301, 0x308, 0x30A,
             0x1100, 0x1161, 0x11A8, 0x3B1, 0x313]  # Hangul jamo; Greek alpha, psili
    for pool in (controls, marks):
        for _ in range(3000):
            s = "".join(chr(rng.choice(pool)) for _ in range(rng.randint(0, 12)))
            assert sp.Normalize(s) == normalize_text(s), repr(s)
    for text in byo.wiki_texts(20) + byo.normalisation_texts():
        for form in ("NFC", "NFD"):
            assert sp.Normalize(unicodedata.normalize(form, text)) == normalize_text(text)


def test_the_sentencepiece_file_for_deberta_encodes_like_the_pipeline(tokenizers, tmp_path):
    """``save_pretrained(sentencepiece_file="spm.model")`` (the DeBERTa export): the model alone,
    as transformers 4.x's slow DebertaV2Tokenizer runs it, and transformers 5's
    DebertaV2Tokenizer, which rebuilds its normaliser from tokenizer.json's charsmap step, give
    the pipeline's ids on paragraph breaks and NFD text; the copy of our model exported before
    gave [UNK] for a paragraph break, and 5.x's class its own normaliser (the controls)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer, DebertaV2Tokenizer

    tok = Tokenizer(tokenizers["ours"])
    written = tok.save_pretrained(tmp_path / "hf", sentencepiece_file="spm.model")
    assert sorted(p.rsplit("/", 1)[1] for p in written) == [
        "spm.model", "tokenizer.json", "tokenizer_config.json"]
    texts = byo.normalisation_texts() + byo.wiki_texts(20)
    slow = spm.SentencePieceProcessor(model_file=str(tmp_path / "hf" / "spm.model"))
    assert [slow.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    again = Tokenizer(tmp_path / "hf" / "spm.model")  # the export's file as --tokenizer-model
    assert again.applies_normalize_text and again.specials == tok.specials
    assert [again.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    pipeline = [[tok.cls_id, *tok.encode(t), tok.sep_id] for t in texts]
    for cls in (DebertaV2Tokenizer, AutoTokenizer):
        assert cls.from_pretrained(str(tmp_path / "hf"))(texts)["input_ids"] == pipeline, cls

    # negative controls: the model as trained (identity normaliser), and 5.x's class without the
    # charsmap step in tokenizer.json
    plain = spm.SentencePieceProcessor(model_file=tokenizers["ours"])
    paragraphs = byo.AUSTEN.split("\u201c")[0]  # the two paragraphs before the quotation marks
    assert tok.unk_id in plain.encode(paragraphs) and tok.unk_id not in tok.encode(paragraphs)
    tok.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "spm.model").write_bytes(open(tokenizers["ours"], "rb").read())
    assert DebertaV2Tokenizer.from_pretrained(str(tmp_path / "plain"))(texts)["input_ids"] != pipeline


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_pretrained_autotokenizer_matches_the_pipeline(tokenizers, layout, tmp_path):
    from transformers import AutoTokenizer

    tok = Tokenizer(tokenizers[layout])
    written = tok.save_pretrained(tmp_path / "hf", model_max_length=512)
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    # the class its docstring names, which transformers 4.x has too (5.x would write
    # TokenizersBackend; loading under 4.57.3: tests/e2e/test_hf_export_transformers4.py)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.unk_token_id, hf.mask_token_id) == (
        tok.pad_id, tok.cls_id, tok.sep_id, tok.unk_id, tok.mask_id)
    assert hf.model_max_length == 512 and len(hf) == tok.vocab_size
    texts = byo.wiki_texts(60) + ["  Leading\tand\u200b trailing\u00a0space, caf\u0065\u0301  ", ""]
    got = hf(texts)["input_ids"]
    for text, ids in zip(texts, got):
        assert ids == [tok.cls_id, *tok.encode(text), tok.sep_id], text
    pair = hf(texts[0], texts[1], return_token_type_ids=True)
    a, b = tok.encode(texts[0]), tok.encode(texts[1])
    assert pair["input_ids"] == [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
    assert pair["token_type_ids"] == [0] * (len(a) + len(b) + 3)  # one token type (one-row table)


def test_an_empty_tokenizer_file_is_one_line_naming_the_flag(tmp_path):
    from rtd_scale.data.tokenizer import Tokenizer, TokenizerModelError

    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(empty)
    assert str(e.value) == (f"--tokenizer-model {empty}: the file is empty (0 bytes); pass a "
                            "SentencePiece .model, a tokenizer.json or a vocab.txt, or train it "
                            "with tools/train_tokenizer.py")
