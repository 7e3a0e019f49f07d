"""Tests for engine.demo_model: offline, deterministic demo models that HF loads, and whose
greedy decoding is decisive and depends on the whole context (so an engine-vs-HF equivalence
test cannot pass with broken attention or positions)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import inspect
import json
import math
import pathlib
import time

import pytest
import torch

from lockgate.engine import demo_model as dm
from lockgate.engine.demo_model import (
    ENDOFTEXT_ID,
    FAMILIES,
    IM_END_ID,
    IM_START_ID,
    random_prompts,
    write_demo_model,
)

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
MULTIBYTE = "Zürich café, naïve façade — 北京欢迎你, 東京, 한국어, Привет мир 👍🏽🚀🙂 ½€ مرحبا"
NEW_TOKENS = 32
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("demo-tiny")
    return {f: write_demo_model(root / f, family=f, size="tiny") for f in FAMILIES}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("demo-small")
    return {f: write_demo_model(root / f, family=f, size="small") for f in FAMILIES}


def _hashes(d: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _load(d: pathlib.Path):
    # the config says float32; no dtype argument (its name differs across transformers versions)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert next(model.parameters()).dtype == torch.float32
    return model.eval(), info


def _safetensors_shapes(path: pathlib.Path) -> dict[str, list[int]]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


# ------------------------------------------------------------------------------------------
# arguments, files, determinism
# ------------------------------------------------------------------------------------------


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="family"):
        write_demo_model(tmp_path, family="gpt2")
    with pytest.raises(ValueError, match="size"):
        write_demo_model(tmp_path, size="huge")
    assert not any(tmp_path.iterdir())


def test_files_and_determinism(tmp_path, tiny):
    for family in FAMILIES:
        a = write_demo_model(tmp_path / f"{family}-a", family=family)
        b = write_demo_model(str(tmp_path / f"{family}-b"), family=family, size="tiny", seed=0)
        assert isinstance(a, pathlib.Path) and a == tmp_path / f"{family}-a"
        assert {p.name for p in a.iterdir()} == FILES
        ha = _hashes(a)
        assert ha == _hashes(b) == _hashes(tiny[family])
        other = _hashes(write_demo_model(tmp_path / f"{family}-s1", family=family, seed=1))
        assert other["model.safetensors"] != ha["model.safetensors"]
        assert {k for k in ha if other[k] != ha[k]} == {"model.safetensors"}
    # the three families differ in weights and config, share the tokenizer
    hs = [_hashes(tiny[f]) for f in FAMILIES]
    assert len({h["model.safetensors"] for h in hs}) == 3
    assert len({h["config.json"] for h in hs}) == 3
    assert len({h["tokenizer.json"] for h in hs}) == 1


def test_tokenizer_training_is_deterministic_and_fast():
    train = dm.build_tokenizer_json.__wrapped__  # bypass the cache
    t0 = time.perf_counter()
    first = train(8192)
    elapsed = time.perf_counter() - t0
    assert train(8192) == first
    assert json.loads(first)["model"]["type"] == "BPE"
    assert elapsed < 6.0, elapsed  # ~0.5 s on an idle core; generous for shared CI machines


def test_write_speed(tmp_path):
    t0 = time.perf_counter()
    write_demo_model(tmp_path / "t", family="mistral", size="tiny", seed=7)
    assert time.perf_counter() - t0 < 4.0


# ------------------------------------------------------------------------------------------
# configs and loading in transformers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_config_fields(tiny, family):
    cfg = json.loads((tiny[family] / "config.json").read_text())
    assert cfg["architectures"] == [ARCH[family]] and cfg["model_type"] == family
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == 512 and cfg["max_position_embeddings"] == 2048
    assert cfg["bos_token_id"] is None
    if family == "llama":
        assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
        assert cfg["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        assert cfg["tie_word_embeddings"] is False
        assert cfg["attention_bias"] is False and cfg["mlp_bias"] is False
    elif family == "qwen2":
        assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 1000000.0
        assert cfg["use_sliding_window"] is False
    else:
        assert cfg["sliding_window"] is None and cfg["tie_word_embeddings"] is False
        assert cfg["rope_theta"] == 10000.0
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"]
    gen = json.loads((tiny[family] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]
    assert gen["pad_token_id"] == ENDOFTEXT_ID and gen.get("bos_token_id") is None


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_loads_tiny(tiny, family):
    model, info = _load(tiny[family])
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert type(model).__name__ == ARCH[family]
    n_params = sum(p.numel() for p in model.parameters())
    assert 50_000 < n_params < 1_000_000
    names = set(_safetensors_shapes(tiny[family] / "model.safetensors"))
    assert set(dict(model.named_parameters())) == names  # HF's own names, nothing more or less
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    } <= names
    if family == "qwen2":
        assert "lm_head.weight" not in names
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert "model.layers.0.self_attn.q_proj.bias" in names
        assert "model.layers.0.self_attn.o_proj.bias" not in names
    else:
        assert "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)


def test_llama3_rope_scaling_is_applied(tiny):
    model, _ = _load(tiny["llama"])
    rot = model.model.rotary_emb
    inv = rot.inv_freq.double()
    d = 16
    plain = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    # llama3: wavelengths < 256/4 kept, > 256/1 divided by 8, smooth in between
    wavelen = 2 * math.pi / plain
    smooth = (256 / wavelen - 1.0) / (4.0 - 1.0)
    want = torch.where(wavelen > 256, plain / 8, plain)
    mid = (wavelen >= 64) & (wavelen <= 256)
    want = torch.where(mid, (1 - smooth) * plain / 8 + smooth * plain, want)
    assert torch.allclose(inv, want, rtol=1e-5)
    assert not torch.allclose(inv, plain)  # the scaling really changes frequencies here


def test_small_models_shapes_and_parameter_counts(small):
    for family, d in small.items():
        cfg = AutoConfig.from_pretrained(d)
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, 4, 8192)
        assert cfg.max_position_embeddings == 4096
        shapes = _safetensors_shapes(d / "model.safetensors")
        n_params = sum(math.prod(s) for s in shapes.values())
        assert 5_000_000 < n_params < 20_000_000, (family, n_params)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        want = {k: list(v.shape) for k, v in model.named_parameters()}
        assert want == shapes, family
        tok = AutoTokenizer.from_pretrained(d)
        assert len(tok) == 8192 and tok.model_max_length == 4096
        assert tok.decode(tok(MULTIBYTE)["input_ids"]) == MULTIBYTE


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer(tiny, family):
    from tokenizers import Tokenizer

    d = tiny[family]
    tok = AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == 512
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END_ID
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == ENDOFTEXT_ID
    assert tok.bos_token is None and tok.model_max_length == 2048
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["add_bos_token"] is False

    for text in (MULTIBYTE, "  two  spaces\n\nand\ttabs 12345 don't", "a", ""):
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids  # transformers' class tokenizes like the file
        assert tok.decode(ids) == text
        assert not set(ids) & {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}  # no BOS/EOS added
    assert len(tok(MULTIBYTE)["input_ids"]) < len(MULTIBYTE.encode())  # merges do happen
    # special tokens in text are single tokens
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == IM_START_ID


def test_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo 東京 🙂"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo 東京 🙂<|im_end|>\n"
        "<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs, tokenize=False) == want
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == want + "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 4 and tok.decode(ids) == s


# ------------------------------------------------------------------------------------------
# greedy behaviour: decisive, diverse, context-dependent, EOS rare
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def _batched_greedy(model, rows, new=NEW_TOKENS):
    """Greedy decode a left-padded batch with a KV cache. rows: (ids, positions or None,
    (lo, hi) span of the prompt masked out of attention or None). Returns (tokens, gaps) with
    gaps[b, t] = top-1 minus top-2 logit at step t."""
    B, T = len(rows), max(len(r[0]) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    nxt = torch.zeros(B, dtype=torch.long)
    for b, (x, p, span) in enumerate(rows):
        off = T - len(x)
        pp = torch.arange(len(x)) if p is None else torch.tensor(p)
        ids[b, off:], pos[b, off:], mask[b, off:] = torch.tensor(x), pp, 1
        if span is not None:
            mask[b, off + span[0] : off + span[1]] = 0
        nxt[b] = max(int(pp.max()) + 1, len(x))
    # transformers 5.2x renamed the KV cache argument/output `past_key_values` -> `cache`
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
    toks, gaps = [], []
    for t in range(new):
        logits = out.logits[:, -1]
        top = torch.topk(logits, 2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
        toks.append(logits.argmax(-1))
        if t == new - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
        cache = out[cache_kw] if cache_kw in out else out["past_key_values"]
        out = model(input_ids=toks[-1][:, None], position_ids=nxt[:, None], attention_mask=mask,
                    use_cache=True, **{cache_kw: cache})
        nxt = nxt + 1
    return torch.stack(toks, 1).tolist(), torch.stack(gaps, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_decisive_diverse_and_context_dependent(tiny, family):
    model, _ = _load(tiny[family])
    tok = AutoTokenizer.from_pretrained(tiny[family])
    V = model.config.vocab_size
    prompts = random_prompts(V)  # 16 prompts, lengths 1..300
    chats = ["Hello!", "What is the capital of France?", "Tell me a story about Zürich 🐉."]
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False) for c in chats]
    texts += [tok("The quick brown fox jumps over the lazy dog.")["input_ids"]]
    long8 = [p for p in prompts if len(p) > 8]
    long16 = [p for p in prompts if len(p) > 16]

    def first_changed(p):
        q = list(p)
        q[0] = 3 + (q[0] - 3 + V // 2) % (V - 3)
        return q

    rows = [(p, None, None) for p in prompts + texts]
    rows += [(p, list(range(len(p)))[::-1], None) for p in long8]  # reversed positions
    rows += [(first_changed(p), None, None) for p in long16]  # only the first token differs
    rows += [(p, None, (len(p) // 4, len(p) // 2)) for p in long8]  # middle quarter masked out
    toks, gaps = _batched_greedy(model, rows)
    n_base = len(prompts) + len(texts)
    base, text_out = toks[: len(prompts)], toks[len(prompts) : n_base]
    rest = toks[n_base:]
    rev, rest = rest[: len(long8)], rest[len(long8) :]
    first, masked = rest[: len(long16)], rest[len(long16) :]
    by_prompt = {id(p): c for p, c in zip(prompts, base, strict=True)}

    # 1. decisive: every generated step's top-1 / top-2 gap is far above float noise
    g = gaps[:n_base].flatten()
    assert g.min().item() > 1e-3, g.min().item()
    assert torch.quantile(g, 0.05).item() > 0.05

    # 2. diverse and not degenerate
    assert len({tuple(c) for c in base}) >= 14
    for c in base + text_out:
        assert max(c.count(x) for x in set(c)) <= NEW_TOKENS // 2, c
        assert len(set(c)) >= 8, c

    # 3. context-dependent
    n_rev = sum(r != by_prompt[id(p)] for p, r in zip(long8, rev, strict=True))
    assert n_rev >= 0.75 * len(long8)
    n_first = sum(r != by_prompt[id(p)] for p, r in zip(long16, first, strict=True))
    assert n_first >= 0.6 * len(long16)
    n_mask = sum(r != by_prompt[id(p)] for p, r in zip(long8, masked, strict=True))
    assert n_mask >= 0.75 * len(long8)

    # 4. EOS is rare
    eos = {IM_END_ID, ENDOFTEXT_ID}
    assert sum(bool(set(c) & eos) for c in base + text_out) <= 2

    # the batched loop agrees with plain unpadded decoding (a short and the longest prompt)
    for i in (0, 1):
        ids = torch.tensor([prompts[i]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=ENDOFTEXT_ID)
        assert out[0, ids.shape[1]:].tolist() == base[i]
