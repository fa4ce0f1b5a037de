"""Tarfa from Python: exact forward passes of Mixture-of-Experts models, with the model's own
router traced, and lm-eval's request semantics for scoring.

Every logit is the bits ``tarfa-run`` computes for the same bundle and tokens, whatever the
thread count, batch or backend (docs/EXACTNESS.md). ``open`` verifies the bundle as the CLI does.

Errors raise :class:`VerificationError` (a bundle or weight did not verify), :class:`InputError`
(bad input or usage) or :class:`EnvironmentError` (I/O, memory, no GPU), all subclasses of
:class:`TarfaError`, with the messages the CLI prints.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np

from . import _tarfa
from ._tarfa import EnvironmentError, InputError, TarfaError, VerificationError

__all__ = [
    "open",
    "Model",
    "Tokenizer",
    "ForwardOutput",
    "TarfaError",
    "VerificationError",
    "InputError",
    "EnvironmentError",
]

# Every capture by name; an unknown one is refused by name, never returned empty.
_CAPTURES = ("residual", "router_logits", "attn_out", "moe_out", "router_probs", "expert_out")

# Token ids cross into the engine as u32.
_MAX_ID = 2**32 - 1


def _token_ids(tokens: Any, what: str = "tokens") -> List[int]:
    """``tokens`` (a sequence of ints or an integer numpy array, one dimension) as a list of ints.

    Floats, booleans, strings and ids outside [0, 2**32) raise InputError here; ids past the
    vocabulary are refused by the engine, with its message."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InputError(f"{what}: expected one dimension of token ids, got shape {arr.shape}")
    if arr.size == 0:
        raise InputError(f"{what}: no tokens")
    if arr.dtype.kind not in "iu":
        raise InputError(f"{what}: expected integer token ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_ID:
        bad = lo if lo < 0 else hi
        raise InputError(f"{what}: token id {bad} is not a valid id")
    return [int(t) for t in arr]


class ForwardOutput:
    """One sequence's forward pass.

    Attributes:
        logits: float32 ``[n, vocab]``, one row per input position (the distribution of the
            next token), bit-identical to ``tarfa-run generate --prefill-logits``.
        moe_layers: the absolute indices of the MoE layers, in order.
        router_topk: ``{layer: int64 [n, k]}``, the selected experts per MoE layer, in selection
            order (descending probability, lower id first on ties).
        router_weights: ``{layer: float32 [n, k]}``, their mixing weights.
        router_topk_probs: ``{layer: float32 [n, k]}``, their softmax probabilities.
        residual: ``{layer: float32 [n, hidden]}`` when ``capture=["residual"]``: the hidden
            state entering ``layer``; at ``num_layers``, after the last layer.
        router_logits: ``{layer: float32 [n, experts]}`` when ``capture=["router_logits"]``.
        attn_out: ``{layer: float32 [n, hidden]}`` when ``capture=["attn_out"]``: the attention
            block's output, before it is added to the residual.
        moe_out: ``{layer: float32 [n, hidden]}`` when ``capture=["moe_out"]``: the MLP block's
            output before the residual add (an MoE layer's routed mix with its shared experts;
            a dense layer's MLP).
        router_probs: ``{layer: float32 [n, experts]}`` when ``capture=["router_probs"]``: the
            router's probabilities over every expert (softmax; the sigmoid scores, before the
            correction bias, for sigmoid routing).
        expert_out: ``{layer: float32 [n, k, hidden]}`` when ``capture=["expert_out"]``: the
            selected experts' outputs before mixing, in ``router_topk``'s order.
        exact: True for the model's own output; False when an intervention changed it.
        interventions: the interventions applied, by name (empty when exact).
    """

    def __init__(self, raw: Dict[str, Any]):
        self.logits: np.ndarray = raw["logits"]
        self.moe_layers: List[int] = list(raw["moe_layers"])
        self.router_topk: Dict[int, np.ndarray] = dict(zip(self.moe_layers, raw["router_topk"]))
        self.router_weights: Dict[int, np.ndarray] = dict(
            zip(self.moe_layers, raw["router_weights"])
        )
        self.router_topk_probs: Dict[int, np.ndarray] = dict(
            zip(self.moe_layers, raw["router_topk_probs"])
        )
        self.weight_bytes: int = raw["weight_bytes"]
        self.experts_fetched: int = raw["experts_fetched"]
        self.residual: Dict[int, np.ndarray] = dict(raw.get("residual", {}))
        self.router_logits: Dict[int, np.ndarray] = dict(raw.get("router_logits", {}))
        self.attn_out: Dict[int, np.ndarray] = dict(raw.get("attn_out", {}))
        self.moe_out: Dict[int, np.ndarray] = dict(raw.get("moe_out", {}))
        self.router_probs: Dict[int, np.ndarray] = dict(raw.get("router_probs", {}))
        self.expert_out: Dict[int, np.ndarray] = dict(raw.get("expert_out", {}))
        self.exact: bool = True
        self.interventions: List[str] = []

    def __repr__(self) -> str:
        n, v = self.logits.shape
        return f"ForwardOutput(n={n}, vocab={v}, moe_layers={self.moe_layers}, exact={self.exact})"


class Tokenizer:
    """The bundle's ``tokenizer.json`` (verified with the bundle) and its chat template."""

    def __init__(self, native: "_tarfa.NativeModel"):
        self._native = native

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of ``text`` (without special tokens unless asked, as ``tarfa-run`` encodes
        a prompt)."""
        return self._native.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return self._native.decode(_token_ids(ids, "ids"), skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Iterable[Dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Union[str, List[int]]:
        """``messages`` (dicts with ``role`` and ``content``) rendered by the bundle's chat
        template, as ``tarfa-run generate --chat`` renders them; token ids when ``tokenize``."""
        pairs = []
        for i, m in enumerate(messages):
            try:
                pairs.append((str(m["role"]), str(m["content"])))
            except (KeyError, TypeError):
                raise InputError(f"messages {i}: expected a dict with 'role' and 'content'") from None
        text = self._native.apply_chat_template(pairs, add_generation_prompt)
        return self.encode(text) if tokenize else text


class Model:
    """A model opened from a verified bundle (see :func:`open`). Usable as a context manager;
    after :meth:`close` every call raises InputError."""

    def __init__(self, native: "_tarfa.NativeModel"):
        self._native = native
        self._config: Optional[Dict[str, Any]] = None

    @property
    def root_digest(self) -> str:
        """The bundle's root digest (its manifest's), as the CLI prints it."""
        return self._native.root_digest

    @property
    def config(self) -> Dict[str, Any]:
        """The bundle's config.json, as a dict."""
        if self._config is None:
            self._config = json.loads(self._native.config_json)
        return self._config

    @property
    def backend(self) -> str:
        """``"cpu"`` or ``"cuda"``: the backend the model was loaded on (``"cuda-mock"`` for
        the test-only mock device)."""
        return self._native.backend

    @property
    def eos_token_ids(self) -> List[int]:
        """The EOS ids generation stops at (generation_config.json's, else config.json's)."""
        return list(self._native.eos_token_ids)

    @property
    def top_k(self) -> int:
        """The experts the router selects per token (``num_experts_per_tok``)."""
        return self._native.top_k

    @property
    def moe_layers(self) -> List[int]:
        """The absolute indices of the MoE layers (the layers ``force`` and ``ablate`` name)."""
        return list(self._native.moe_layers)

    @property
    def tokenizer(self) -> Tokenizer:
        """The bundle's tokenizer; InputError when the bundle has none."""
        if not self._native.has_tokenizer:
            raise InputError("the bundle has no tokenizer.json")
        return Tokenizer(self._native)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (every call then raises InputError)."""
        return self._native.closed

    def close(self) -> None:
        """Frees the weights, caches and threads now."""
        self._native.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def forward(
        self,
        tokens: Any,
        capture: Sequence[str] = (),
        layers: Optional[Sequence[int]] = None,
        residual_add: Optional[Dict[int, Any]] = None,
        residual_replace: Optional[Dict[int, Any]] = None,
        ablate: Optional[Dict[int, Sequence[int]]] = None,
        force: Optional[Dict[int, Any]] = None,
    ) -> ForwardOutput:
        """One fresh sequence of ``tokens`` through the model: every position's logits, the
        router's choices in every MoE layer, and the captures asked for (see
        :meth:`forward_batch`)."""
        return self.forward_batch(
            [tokens],
            capture=capture,
            layers=layers,
            residual_add=residual_add,
            residual_replace=residual_replace,
            ablate=ablate,
            force=force,
        )[0]

    def forward_batch(
        self,
        batch: Sequence[Any],
        capture: Sequence[str] = (),
        layers: Optional[Sequence[int]] = None,
        residual_add: Optional[Dict[int, Any]] = None,
        residual_replace: Optional[Dict[int, Any]] = None,
        ablate: Optional[Dict[int, Sequence[int]]] = None,
        force: Optional[Dict[int, Any]] = None,
    ) -> List[ForwardOutput]:
        """Each entry of ``batch`` as its own fresh sequence, all run as one engine step; each
        output is the same bits as :meth:`forward` of that entry alone.

        ``capture``: ``"residual"`` puts in ``out.residual[layer]`` (float32 ``[n, hidden]``)
        the hidden state entering each layer, and at ``num_layers`` the state after the last
        layer, before the final norm; ``"router_logits"`` puts in ``out.router_logits[layer]``
        (float32 ``[n, experts]``) each MoE layer's router logits, before the softmax;
        ``"attn_out"``, ``"moe_out"``, ``"router_probs"`` and ``"expert_out"`` are described
        on :class:`ForwardOutput`. ``layers`` limits captures to those indices (memory). Captures only observe: the
        logits are the same bits. On CUDA too, the same bits as the CPU's (interventions there raise InputError).

        Interventions (never the default; the output says ``exact=False`` and names each in
        ``interventions``): ``residual_add={layer: delta}`` adds ``delta`` to the residual
        entering ``layer``, ``residual_replace={layer: value}`` replaces it (``layer ==
        num_layers``: the state before the final norm). Each value is float32, ``[hidden]``
        (every token) or ``[tokens, hidden]`` (every token of the batch, in order). Additions
        at a layer apply before replacements there. ``ablate={layer: [expert ids]}``: the
        router of that MoE layer never selects those experts (their router logits become -inf
        before the softmax; the captured router logits show that).

        ``force={layer: experts}`` replaces the router's top-k choice at that MoE layer by
        ``experts``: ``[k]`` ids (every token), or ``[tokens, k]`` (each token of the batch, in
        order; a row of ``-1`` leaves that token's choice to the router), ``k`` the model's
        ``num_experts_per_tok`` (:attr:`Model.top_k`), distinct ids. The forced set is put in the router's own order
        (descending router score, lower id first among equals) and weighted by the family's own
        rule over it: softmax routers use their softmax probabilities of the forced experts
        (over all experts), renormalised over the forced set when the model renormalises its
        top-k (``norm_topk_prob``); sigmoid routers (DeepSeek-V3, GLM-4.5) their sigmoid
        scores, renormalised when configured, times ``routed_scaling_factor``; DeepSeek-V2
        their probabilities times ``routed_scaling_factor``; gpt-oss the softmax over the
        forced experts' logits; Llama 4 each forced expert's ``sigmoid(logit)``, which scales
        that expert's input. So forcing the router's own choice changes no bit, and
        ``router_topk``/``router_weights``/``router_topk_probs`` show the forced route
        (``router_logits`` and ``router_probs`` stay the router's own). A layer cannot be both
        forced and ablated.

        A long call is interrupted by Ctrl-C (``KeyboardInterrupt``) before the next attention
        or MLP block on the CPU (between calls on CUDA); the model stays usable."""
        if isinstance(batch, (str, bytes)) or len(batch) == 0:
            raise InputError("batch: expected a non-empty list of token sequences")
        ids = [_token_ids(t, f"tokens {i}") for i, t in enumerate(batch)]
        capture = [capture] if isinstance(capture, str) else list(capture)
        for name in capture:
            if name not in _CAPTURES:
                raise InputError(
                    f"capture: unknown capture {name!r} (available: "
                    + ", ".join(repr(c) for c in _CAPTURES)
                    + ")"
                )
        if not capture and layers is not None:
            raise InputError("layers: selects the layers of a capture; no capture was asked for")
        n = self.config["num_hidden_layers"]
        wanted = None if layers is None else [int(x) for x in _token_ids(layers, "layers")]
        residual_layers = router_layers = None
        if "residual" in capture:
            residual_layers = list(range(n + 1)) if wanted is None else wanted

        def per_layer(name: str) -> Optional[List[int]]:
            if name not in capture:
                return None
            return list(range(n)) if wanted is None else [x for x in wanted if x < n]

        router_layers = per_layer("router_logits")
        attn_layers, moe_layers = per_layer("attn_out"), per_layer("moe_out")
        probs_layers, expert_layers = per_layer("router_probs"), per_layer("expert_out")
        total = sum(len(t) for t in ids)
        edits, names = [], []
        for label, replace, given in (
            ("residual_add", False, residual_add),
            ("residual_replace", True, residual_replace),
        ):
            if given is None:
                continue
            if not isinstance(given, dict):
                raise InputError(f"{label}: expected a dict {{layer: float32 array}}")
            for layer, value in sorted(given.items()):
                rows = self._edit_rows(f"{label}[{layer}]", value, total)
                edits.append((int(layer), replace, rows))
                names.append(f"{label}(layer={int(layer)})")
        cuts = None
        if ablate is not None:
            if not isinstance(ablate, dict):
                raise InputError("ablate: expected a dict {layer: [expert ids]}")
            cuts = []
            for layer, experts in sorted(ablate.items()):
                e = [int(x) for x in _token_ids(experts, f"ablate[{layer}]")]
                cuts.append((int(layer), e))
                names.append(f"ablate(layer={int(layer)}, experts={sorted(set(e))})")
        forced = None
        if force is not None:
            if not isinstance(force, dict):
                raise InputError("force: expected a dict {layer: expert ids}")
            forced = []
            for layer, experts in sorted(force.items()):
                rows = self._forced_rows(f"force[{layer}]", experts, total)
                forced.append((int(layer), rows))
                arr = np.asarray(experts)
                what = (
                    f"experts={[int(e) for e in arr]}"
                    if arr.ndim == 1
                    else "experts=per token"
                )
                names.append(f"force(layer={int(layer)}, {what})")
        raw = self._native.forward_batch(
            ids,
            residual_layers,
            edits or None,
            router_layers,
            cuts,
            attn_layers,
            moe_layers,
            probs_layers,
            expert_layers,
            forced,
        )
        outs = [ForwardOutput(r) for r in raw]
        if names:
            for o in outs:
                o.exact = False
                o.interventions = list(names)
        return outs

    def _forced_rows(self, what: str, value: Any, total: int) -> List[int]:
        """A force's experts as ``total`` rows of ``k`` ids (-1: the router's choice), flattened."""
        k = self._native.top_k
        arr = np.asarray(value)
        if arr.size == 0 or arr.dtype.kind not in "iu":
            raise InputError(f"{what}: expected integer expert ids, got {arr.dtype} {arr.shape}")
        if arr.shape == (k,):
            arr = np.broadcast_to(arr, (total, k))
        elif arr.shape != (total, k):
            raise InputError(
                f"{what}: expected shape ({k},) or ({total}, {k}) (the router selects {k} "
                f"experts per token), got {arr.shape}"
            )
        return [int(x) for x in np.ascontiguousarray(arr).ravel()]

    def _edit_rows(self, what: str, value: Any, total: int) -> List[float]:
        """An intervention's value as ``total`` rows of ``hidden`` float32, flattened."""
        hidden = self.config["hidden_size"]
        arr = np.asarray(value)
        if arr.dtype != np.float32:
            raise InputError(f"{what}: expected a float32 array, got dtype {arr.dtype}")
        if arr.shape == (hidden,):
            arr = np.broadcast_to(arr, (total, hidden))
        elif arr.shape != (total, hidden):
            raise InputError(
                f"{what}: expected shape ({hidden},) or ({total}, {hidden}), got {arr.shape}"
            )
        return np.ascontiguousarray(arr).ravel().tolist()

    def score(
        self,
        requests: Sequence[Dict[str, Any]],
        top_logprobs: int = 0,
        echo: bool = False,
        max_batch: int = 1,
    ) -> List[Dict[str, Any]]:
        """Scores lm-eval requests, each a dict of the ``tarfa-run score`` requests file's keys
        (``context`` + ``continuation``: loglikelihood; ``rolling``: loglikelihood_rolling;
        ``context`` + ``max_tokens``: generate_until, with ``until``, ``temperature``, ``seed``
        ...). Returns one dict per request, the numbers ``tarfa-run score`` writes."""
        if isinstance(requests, dict):
            raise InputError("requests: expected a list of request dicts")
        lines = []
        for i, r in enumerate(requests):
            if not isinstance(r, dict):
                raise InputError(f"request {i}: expected a dict, got {type(r).__name__}")
            lines.append(json.dumps(r))
        out = self._native.score(lines, top_logprobs, echo, max_batch)
        return [json.loads(line) for line in out]

    def generate(
        self,
        prompt: Union[str, Sequence[int]],
        max_tokens: int = 16,
        until: Optional[Sequence[str]] = None,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        seed: Optional[int] = None,
        top_logprobs: int = 0,
    ) -> Dict[str, Any]:
        """Greedy (``temperature=0``) or sampled continuation of ``prompt`` (text, or token
        ids): a generate_until request, so the same tokens as ``tarfa-run score`` and
        ``tarfa-run generate`` with the same settings and seed. Returns ``text`` (None without a
        tokenizer), ``tokens``, ``token_logprobs`` and ``finish_reason``."""
        req: Dict[str, Any] = {
            "context": prompt if isinstance(prompt, str) else _token_ids(prompt, "prompt"),
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        for key, value in (
            ("until", None if until is None else list(until)),
            ("top_k", top_k),
            ("top_p", top_p),
            ("min_p", min_p),
            ("seed", seed),
        ):
            if value is not None:
                req[key] = value
        return self.score([req], top_logprobs=top_logprobs)[0]

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return f"tarfa.Model(root_digest={self.root_digest!r}, {state})"


def open(
    bundle: Union[str, "os.PathLike[str]"],
    backend: str = "auto",
    threads: Optional[int] = None,
    ram_budget: Optional[int] = None,
    vram_budget: Optional[int] = None,
    expect_root: Optional[str] = None,
    log: bool = False,
) -> Model:
    """Opens and verifies the bundle directory ``bundle`` as ``tarfa-run`` does, and loads it.

    Args:
        backend: ``"auto"`` (CUDA when a usable GPU is present, else the CPU), ``"cpu"`` or
            ``"cuda"``. For tests, ``"cuda-mock"``: the CUDA backend on tarfa-cuda's mock device
            (host memory, no GPU), in a build with that crate's ``mock-device`` feature (the CI
            wheel); otherwise EnvironmentError.
        threads: CPU worker threads (None or 0: one per core). Never changes a bit.
        ram_budget: bytes of RAM for experts (``--ram-budget``); None: every expert stays once
            read, unless memory cannot hold them.
        vram_budget: bytes of GPU memory for experts (``--vram-budget``, CUDA only).
        expect_root: refuse the bundle unless its root digest is this (``--expect-root``).
        log: print what the CLI logs (root digest, backend) to stderr.
    """
    for name, v in (("threads", threads), ("ram_budget", ram_budget), ("vram_budget", vram_budget)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InputError(f"{name}: expected a non-negative integer, got {v!r}")
    return Model(
        _tarfa.NativeModel(
            os.fspath(bundle), backend, threads, ram_budget, vram_budget, expect_root, log
        )
    )
