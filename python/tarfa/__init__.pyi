import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

class TarfaError(Exception): ...
class VerificationError(TarfaError): ...
class InputError(TarfaError): ...
class EnvironmentError(TarfaError): ...

TokenIds = Union[Sequence[int], npt.NDArray[np.integer[Any]]]

class ForwardOutput:
    logits: npt.NDArray[np.float32]
    moe_layers: List[int]
    router_topk: Dict[int, npt.NDArray[np.int64]]
    router_weights: Dict[int, npt.NDArray[np.float32]]
    router_topk_probs: Dict[int, npt.NDArray[np.float32]]
    residual: Dict[int, npt.NDArray[np.float32]]
    router_logits: Dict[int, npt.NDArray[np.float32]]
    attn_out: Dict[int, npt.NDArray[np.float32]]
    moe_out: Dict[int, npt.NDArray[np.float32]]
    router_probs: Dict[int, npt.NDArray[np.float32]]
    expert_out: Dict[int, npt.NDArray[np.float32]]
    weight_bytes: int
    experts_fetched: int
    exact: bool
    interventions: List[str]

class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]: ...
    def decode(self, ids: TokenIds, skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(
        self,
        messages: Iterable[Dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Union[str, List[int]]: ...

class Model:
    @property
    def root_digest(self) -> str: ...
    @property
    def config(self) -> Dict[str, Any]: ...
    @property
    def backend(self) -> str: ...
    @property
    def eos_token_ids(self) -> List[int]: ...
    @property
    def top_k(self) -> int: ...
    @property
    def moe_layers(self) -> List[int]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Model: ...
    def __exit__(self, *exc: Any) -> None: ...
    def forward(
        self,
        tokens: TokenIds,
        capture: Sequence[str] = (),
        layers: Optional[Sequence[int]] = None,
        residual_add: Optional[Dict[int, npt.NDArray[np.float32]]] = None,
        residual_replace: Optional[Dict[int, npt.NDArray[np.float32]]] = None,
        ablate: Optional[Dict[int, Sequence[int]]] = None,
        force: Optional[Dict[int, Union[Sequence[int], npt.NDArray[np.integer[Any]]]]] = None,
    ) -> ForwardOutput: ...
    def forward_batch(
        self,
        batch: Sequence[TokenIds],
        capture: Sequence[str] = (),
        layers: Optional[Sequence[int]] = None,
        residual_add: Optional[Dict[int, npt.NDArray[np.float32]]] = None,
        residual_replace: Optional[Dict[int, npt.NDArray[np.float32]]] = None,
        ablate: Optional[Dict[int, Sequence[int]]] = None,
        force: Optional[Dict[int, Union[Sequence[int], npt.NDArray[np.integer[Any]]]]] = None,
    ) -> List[ForwardOutput]: ...
    def score(
        self,
        requests: Sequence[Dict[str, Any]],
        top_logprobs: int = 0,
        echo: bool = False,
        max_batch: int = 1,
    ) -> List[Dict[str, Any]]: ...
    def generate(
        self,
        prompt: Union[str, TokenIds],
        max_tokens: int = 16,
        until: Optional[Sequence[str]] = None,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        seed: Optional[int] = None,
        top_logprobs: int = 0,
    ) -> Dict[str, Any]: ...

def open(
    bundle: Union[str, os.PathLike[str]],
    backend: str = "auto",
    threads: Optional[int] = None,
    ram_budget: Optional[int] = None,
    vram_budget: Optional[int] = None,
    expect_root: Optional[str] = None,
    log: bool = False,
) -> Model: ...
