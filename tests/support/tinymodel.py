"""A tiny random-weight LLaMA GGUF for fast tests, written with the `gguf` package.

The model is meaningless but deterministic (given the seed) and cheap: well under
1 MB, loads in milliseconds, and greedy decoding yields varied, prompt-dependent
text made of printable ASCII pieces.  Special tokens (<s>, </s>, <|im_start|>,
<|im_end|>) and non-ASCII byte tokens are pushed down by a constant "bias" channel
so that generation never stops early and always detokenizes to clean text.
"""

from __future__ import annotations

import logging
import os
import string

import numpy as np

logger = logging.getLogger(__name__)

# Exactly llama_cpp.llama_chat_format.CHATML_CHAT_TEMPLATE, so llama-cpp-python
# recognises it and picks its built-in "chatml" chat format.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' "
    "+ message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPACE = "\u2581"  # SentencePiece's visible space
_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_BIGRAMS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le "
    "ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns di fo ho pe ec "
    "pr no ct us ac ot il tr ly nc et ut ss so rs un lo wa ge ie wh ee wi em ad ol rt po we na "
    "ul ni ts mo ow pa im mi ai sh ir su id os iv ia am fi ci vi pl ig tu ev ld ry mp fe bl ab"
).split()
_WORDS = "the and of to in is it that for you was with on as are be this have or at by not".split()


def _build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int], list[bool]]:
    """Return (pieces, scores, token types, suppress-mask) for an SPM vocab of n_vocab tokens."""
    from gguf import TokenType

    pieces: list[str] = []
    types: list[int] = []
    for tok in _SPECIALS:
        pieces.append(tok)
        types.append(TokenType.UNKNOWN if tok == "<unk>" else TokenType.CONTROL)
    for b in range(256):
        pieces.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
    # Normal pieces, most basic first: the visible space, printable chars, word starts,
    # bigrams, whole words.  Every longer piece splits into shorter ones in the vocab,
    # so SPM merging can reach it.
    printable = [c for c in string.printable if c.isprintable() and c != " "]
    normal = [_SPACE, *printable]
    normal += [_SPACE + c for c in string.ascii_lowercase + string.ascii_uppercase]
    normal += _BIGRAMS
    normal += [_SPACE + w for w in _WORDS]
    seen = set(pieces)
    normal = [p for p in dict.fromkeys(normal) if p not in seen]
    room = n_vocab - len(pieces)
    if room < len(printable) + 1:
        raise ValueError(
            f"n_vocab={n_vocab} too small: need at least {len(pieces) + len(printable) + 1}"
        )
    normal = normal[:room]
    pieces += normal
    types += [TokenType.NORMAL] * len(normal)
    # Pad with unused filler tokens if a larger vocab was requested.
    while len(pieces) < n_vocab:
        pieces.append(f"<unused{len(pieces)}>")
        types.append(TokenType.UNUSED)
    # SPM merges by score: higher merges first; prefer longer pieces.
    scores = [
        0.0 if t != TokenType.NORMAL else float(len(p)) - i * 1e-3
        for i, (p, t) in enumerate(zip(pieces, types, strict=True))
    ]
    # Never sample specials, unused fillers, control/non-ASCII bytes: keeps text clean
    # and generation running until max_tokens.
    suppress = []
    for p, t in zip(pieces, types, strict=True):
        if t == TokenType.BYTE:
            b = int(p[3:5], 16)
            suppress.append(not (0x20 <= b < 0x7F or b == 0x0A))
        else:
            suppress.append(t != TokenType.NORMAL)
    return pieces, scores, [int(t) for t in types], suppress


def _finish(
    w, pieces: list[str], scores: list[float], types: list[int], tensors: dict[str, np.ndarray]
) -> None:
    """The tokenizer (SPM, ChatML template), the tensors, and write the file."""
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_vocab: int = 512,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ctx_train: int = 2048,
) -> None:
    """Write a tiny deterministic random-weight LLaMA-architecture GGUF (f32) to `path`."""
    import gguf

    if n_embd % n_head:
        raise ValueError("n_embd must be divisible by n_head")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError("head dimension must be even for RoPE")
    n_ff = 4 * n_embd
    rng = np.random.default_rng(seed)
    pieces, scores, types, suppress = _build_vocab(n_vocab)

    def lin(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)

    # Channel 0 of the residual stream is a constant (never written by any layer), so
    # after the final RMSNorm it acts as a bias input for the output projection.
    bias_ch = 0
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    embd[:, bias_ch] = 1.0

    tensors: dict[str, np.ndarray] = {"token_embd.weight": embd}
    for i in range(n_layer):
        attn_out = lin(n_embd, n_embd, 1.0)
        ffn_down = lin(n_embd, n_ff, 1.0)
        attn_out[bias_ch, :] = 0.0
        ffn_down[bias_ch, :] = 0.0
        tensors |= {
            f"blk.{i}.attn_norm.weight": np.ones(n_embd, dtype=np.float32),
            # Sharp attention: far-back tokens still sway greedy output (a single-token
            # change in a 500-token prompt alters 24 greedy tokens ~75% of the time).
            f"blk.{i}.attn_q.weight": lin(n_embd, n_embd, 4.0),
            f"blk.{i}.attn_k.weight": lin(n_embd, n_embd, 4.0),
            f"blk.{i}.attn_v.weight": lin(n_embd, n_embd, 1.0),
            f"blk.{i}.attn_output.weight": attn_out,
            f"blk.{i}.ffn_norm.weight": np.ones(n_embd, dtype=np.float32),
            f"blk.{i}.ffn_gate.weight": lin(n_ff, n_embd, 1.0),
            f"blk.{i}.ffn_up.weight": lin(n_ff, n_embd, 1.0),
            f"blk.{i}.ffn_down.weight": ffn_down,
        }
    output = lin(n_vocab, n_embd, 3.0)
    output[:, bias_ch] = np.where(suppress, -50.0, 0.0).astype(np.float32)
    tensors["output_norm.weight"] = np.ones(n_embd, dtype=np.float32)
    tensors["output.weight"] = output

    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name(f"tiny-llama-seed{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)  # GQA tiny models fail in llama.cpp (see NOTES.md)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _finish(w, pieces, scores, types, tensors)
    logger.debug(
        "wrote tiny llama seed=%d vocab=%d embd=%d layers=%d to %s",
        seed,
        n_vocab,
        n_embd,
        n_layer,
        path,
    )


def write_tiny_gemma3(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_vocab: int = 512,
    n_embd: int = 64,
    n_layer: int = 6,
    n_head: int = 4,
    n_swa: int = 32,
    n_ctx_train: int = 2048,
) -> None:
    """Write a tiny random-weight Gemma 3 GGUF (f32) with sliding-window attention.

    llama.cpp makes five of every six Gemma 3 layers sliding-window layers of width
    ``n_swa``: the serialized state of such a context keeps only the last ``n_swa``
    positions of those layers, which is what the SWA tests need to exercise.
    """
    import gguf

    head_dim = n_embd // n_head
    n_ff = 4 * n_embd
    rng = np.random.default_rng(seed)
    pieces, scores, types, suppress = _build_vocab(n_vocab)

    def lin(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)

    bias_ch = 0  # as in write_tiny_llama: a constant channel biases the output
    embd = (rng.standard_normal((n_vocab, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    embd[:, bias_ch] = 1.0 / np.sqrt(n_embd)  # Gemma scales embeddings by sqrt(n_embd)
    ones = np.ones(n_embd, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {"token_embd.weight": embd}
    for i in range(n_layer):
        attn_out = lin(n_embd, n_embd, 1.0)
        ffn_down = lin(n_embd, n_ff, 1.0)
        attn_out[bias_ch, :] = 0.0
        ffn_down[bias_ch, :] = 0.0
        tensors |= {
            f"blk.{i}.attn_norm.weight": ones,
            f"blk.{i}.attn_q.weight": lin(n_embd, n_embd, 4.0),
            f"blk.{i}.attn_k.weight": lin(n_embd, n_embd, 4.0),
            f"blk.{i}.attn_v.weight": lin(n_embd, n_embd, 1.0),
            f"blk.{i}.attn_q_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
            f"blk.{i}.attn_k_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
            f"blk.{i}.attn_output.weight": attn_out,
            f"blk.{i}.post_attention_norm.weight": ones,
            f"blk.{i}.ffn_norm.weight": ones,
            f"blk.{i}.ffn_gate.weight": lin(n_ff, n_embd, 1.0),
            f"blk.{i}.ffn_up.weight": lin(n_ff, n_embd, 1.0),
            f"blk.{i}.ffn_down.weight": ffn_down,
            f"blk.{i}.post_ffw_norm.weight": ones,
        }
    output = lin(n_vocab, n_embd, 3.0)
    output[:, bias_ch] = np.where(suppress, -50.0, 0.0).astype(np.float32)
    tensors["output_norm.weight"] = ones
    tensors["output.weight"] = output

    w = gguf.GGUFWriter(os.fspath(path), "gemma3")
    w.add_name(f"tiny-gemma3-seed{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(n_swa)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    _finish(w, pieces, scores, types, tensors)


def write_tiny_lora(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    rank: int = 4,
    alpha: float = 8.0,
) -> None:
    """Write a random LoRA adapter (f32) for the attention Q and V of ``write_tiny_llama``."""
    import gguf

    rng = np.random.default_rng(1000 + seed)
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for i in range(n_layer):
        for name in ("attn_q", "attn_v"):
            # (rows, cols): lora_a is (rank, n_in), lora_b is (n_out, rank)
            a = rng.standard_normal((rank, n_embd)).astype(np.float32) / np.sqrt(n_embd)
            b = rng.standard_normal((n_embd, rank)).astype(np.float32)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------ more architectures
# The tiny-model matrix: one model per family whose states llama.cpp serializes
# differently. Each keeps channel 0 of the residual stream constant (every layer's
# output projection writes zeros there), so that, as in write_tiny_llama, it biases the
# output projection away from specials and non-ASCII bytes.


class _Tiny:
    """Random tensors of one tiny model, and its GGUF header."""

    def __init__(self, seed: int, n_vocab: int, n_embd: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_vocab, self.n_embd = n_vocab, n_embd
        self.pieces, self.scores, self.types, self.suppress = _build_vocab(n_vocab)
        embd = self.rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
        embd[:, 0] = 1.0
        self.tensors: dict[str, np.ndarray] = {"token_embd.weight": embd}

    def lin(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)

    def out_proj(self, n_in: int, gain: float = 1.0) -> np.ndarray:
        """A projection back into the residual stream, leaving channel 0 alone."""
        w = self.lin(self.n_embd, n_in, gain)
        w[0, :] = 0.0
        return w

    def ones(self, n: int | None = None) -> np.ndarray:
        return np.ones(self.n_embd if n is None else n, dtype=np.float32)

    def ffn(self, i: int, n_ff: int) -> None:
        self.tensors |= {
            f"blk.{i}.ffn_gate.weight": self.lin(n_ff, self.n_embd),
            f"blk.{i}.ffn_up.weight": self.lin(n_ff, self.n_embd),
            f"blk.{i}.ffn_down.weight": self.out_proj(n_ff),
        }

    def write(self, path: str | os.PathLike[str], arch: str, name: str, **keys: object) -> None:
        """Add the output head and write the file; ``keys``: ``GGUFWriter.add_<key>(value)``."""
        import gguf

        output = self.lin(self.n_vocab, self.n_embd, 3.0)
        output[:, 0] = np.where(self.suppress, -400.0, 0.0).astype(np.float32)
        self.tensors["output_norm.weight"] = self.ones()
        self.tensors["output.weight"] = output
        w = gguf.GGUFWriter(os.fspath(path), arch)
        w.add_name(name)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_vocab_size(self.n_vocab)
        w.add_context_length(2048)
        w.add_embedding_length(self.n_embd)
        for key, value in keys.items():
            getattr(w, f"add_{key}")(value)
        _finish(w, self.pieces, self.scores, self.types, self.tensors)


def write_tiny_mamba(
    path: str | os.PathLike[str], *, seed: int = 0, n_embd: int = 64, n_layer: int = 2
) -> None:
    """A tiny Mamba (1): recurrent layers only, no attention. Its state is a fixed-size
    summary of every token so far; llama.cpp cannot cut it back to a shorter prefix."""
    m = _Tiny(seed, 512, n_embd)
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 16, 4, 8
    for i in range(n_layer):
        m.tensors |= {
            f"blk.{i}.attn_norm.weight": m.ones(),
            f"blk.{i}.ssm_in.weight": m.lin(2 * d_inner, n_embd),
            f"blk.{i}.ssm_conv1d.weight": m.lin(d_inner, d_conv),
            f"blk.{i}.ssm_conv1d.bias": np.zeros(d_inner, dtype=np.float32),
            f"blk.{i}.ssm_x.weight": m.lin(dt_rank + 2 * d_state, d_inner, 3.0),
            f"blk.{i}.ssm_dt.weight": m.lin(d_inner, dt_rank),
            f"blk.{i}.ssm_dt.bias": np.full(d_inner, -3.0, dtype=np.float32),
            # A = -exp(A_log), slow decays: far-back tokens still sway the output
            f"blk.{i}.ssm_a": -m.rng.uniform(0.001, 0.1, (d_inner, d_state)).astype(np.float32),
            f"blk.{i}.ssm_d": m.ones(d_inner),
            f"blk.{i}.ssm_out.weight": m.out_proj(d_inner, 4.0),
        }
    m.write(
        path,
        "mamba",
        f"tiny-mamba-seed{seed}",
        block_count=n_layer,
        feed_forward_length=0,
        head_count=0,
        layer_norm_rms_eps=1e-5,
        ssm_conv_kernel=d_conv,
        ssm_inner_size=d_inner,
        ssm_state_size=d_state,
        ssm_time_step_rank=dt_rank,
    )


def write_tiny_qwen35(
    path: str | os.PathLike[str], *, seed: int = 0, n_embd: int = 64, n_layer: int = 4
) -> None:
    """A tiny Qwen 3.5 (``qwen35``), a hybrid: three gated delta-net (recurrent) layers,
    then a full-attention layer (``full_attention_interval`` 4), as the real ones."""
    m = _Tiny(seed, 512, n_embd)
    n_head, head_dim, n_ff = 4, 16, 4 * n_embd
    # delta net: k heads of head_k_dim (state_size), v heads (time_step_rank) sharing
    # inner_size, conv over q, k and v
    d_state, n_group, n_v_head, d_inner, d_conv = 16, 2, 4, 64, 4
    qkv = 2 * n_group * d_state + d_inner
    for i in range(n_layer):
        m.tensors |= {
            f"blk.{i}.attn_norm.weight": m.ones(),
            f"blk.{i}.post_attention_norm.weight": m.ones(),
        }
        m.ffn(i, n_ff)
        if (i + 1) % 4 == 0:  # full attention, its query doubled by an output gate
            m.tensors |= {
                f"blk.{i}.attn_q.weight": m.lin(2 * n_head * head_dim, n_embd, 4.0),
                f"blk.{i}.attn_k.weight": m.lin(n_head * head_dim, n_embd, 4.0),
                f"blk.{i}.attn_v.weight": m.lin(n_head * head_dim, n_embd),
                f"blk.{i}.attn_output.weight": m.out_proj(n_head * head_dim),
                f"blk.{i}.attn_q_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
                f"blk.{i}.attn_k_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
            }
        else:
            m.tensors |= {
                f"blk.{i}.attn_qkv.weight": m.lin(qkv, n_embd),
                f"blk.{i}.attn_gate.weight": m.lin(d_inner, n_embd),
                f"blk.{i}.ssm_conv1d.weight": m.lin(qkv, d_conv),
                f"blk.{i}.ssm_a": -m.rng.uniform(0.01, 0.5, n_v_head).astype(np.float32),
                f"blk.{i}.ssm_dt.bias": np.zeros(n_v_head, dtype=np.float32),
                f"blk.{i}.ssm_alpha.weight": m.lin(n_v_head, n_embd),
                f"blk.{i}.ssm_beta.weight": m.lin(n_v_head, n_embd),
                f"blk.{i}.ssm_norm.weight": m.ones(d_inner // n_v_head),
                f"blk.{i}.ssm_out.weight": m.out_proj(d_inner),
            }
    m.write(
        path,
        "qwen35",
        f"tiny-qwen35-seed{seed}",
        block_count=n_layer,
        feed_forward_length=n_ff,
        head_count=n_head,
        head_count_kv=n_head,
        key_length=head_dim,
        value_length=head_dim,
        rope_dimension_count=head_dim,
        rope_dimension_sections=[4, 2, 2, 0],
        rope_freq_base=10000.0,
        layer_norm_rms_eps=1e-6,
        ssm_conv_kernel=d_conv,
        ssm_inner_size=d_inner,
        ssm_state_size=d_state,
        ssm_time_step_rank=n_v_head,
        ssm_group_count=n_group,
        full_attention_interval=4,
    )


def _attention(m: _Tiny, i: int, n_head: int, head_dim: int) -> None:
    n_embd = m.n_embd
    m.tensors |= {
        f"blk.{i}.attn_norm.weight": m.ones(),
        f"blk.{i}.attn_q.weight": m.lin(n_head * head_dim, n_embd, 4.0),
        f"blk.{i}.attn_k.weight": m.lin(n_head * head_dim, n_embd, 4.0),
        f"blk.{i}.attn_v.weight": m.lin(n_head * head_dim, n_embd),
        f"blk.{i}.attn_output.weight": m.out_proj(n_head * head_dim),
        f"blk.{i}.ffn_norm.weight": m.ones(),
    }


def write_tiny_qwen2(
    path: str | os.PathLike[str], *, seed: int = 0, n_embd: int = 64, n_layer: int = 2
) -> None:
    """A tiny Qwen 2: attention with biases on the query, key and value projections."""
    m = _Tiny(seed, 512, n_embd)
    n_head, head_dim = 4, n_embd // 4
    for i in range(n_layer):
        _attention(m, i, n_head, head_dim)
        for name in ("attn_q", "attn_k", "attn_v"):
            m.tensors[f"blk.{i}.{name}.bias"] = 0.5 * m.rng.standard_normal(n_embd).astype(
                np.float32
            )
        m.ffn(i, 4 * n_embd)
    m.write(
        path,
        "qwen2",
        f"tiny-qwen2-seed{seed}",
        block_count=n_layer,
        feed_forward_length=4 * n_embd,
        head_count=n_head,
        head_count_kv=n_head,
        rope_freq_base=10000.0,
        layer_norm_rms_eps=1e-6,
    )


def write_tiny_qwen3moe(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_expert: int = 4,
    n_expert_used: int = 2,
) -> None:
    """A tiny Qwen 3 MoE: a router picks ``n_expert_used`` of ``n_expert`` feed-forward
    experts per token."""
    m = _Tiny(seed, 512, n_embd)
    n_head, head_dim, n_ff = 4, n_embd // 4, 2 * n_embd
    for i in range(n_layer):
        _attention(m, i, n_head, head_dim)
        down = np.stack([m.out_proj(n_ff) for _ in range(n_expert)])
        m.tensors |= {
            f"blk.{i}.attn_q_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
            f"blk.{i}.attn_k_norm.weight": np.full(head_dim, 3.0, dtype=np.float32),
            f"blk.{i}.ffn_gate_inp.weight": m.lin(n_expert, n_embd, 4.0),
            f"blk.{i}.ffn_gate_exps.weight": np.stack(
                [m.lin(n_ff, n_embd) for _ in range(n_expert)]
            ),
            f"blk.{i}.ffn_up_exps.weight": np.stack([m.lin(n_ff, n_embd) for _ in range(n_expert)]),
            f"blk.{i}.ffn_down_exps.weight": down,
        }
    m.write(
        path,
        "qwen3moe",
        f"tiny-qwen3moe-seed{seed}",
        block_count=n_layer,
        feed_forward_length=n_ff,
        expert_feed_forward_length=n_ff,
        expert_count=n_expert,
        expert_used_count=n_expert_used,
        head_count=n_head,
        head_count_kv=n_head,
        key_length=head_dim,
        value_length=head_dim,
        rope_freq_base=10000.0,
        layer_norm_rms_eps=1e-6,
    )
