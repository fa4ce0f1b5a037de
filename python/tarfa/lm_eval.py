"""The lm-evaluation-harness model ``tarfa``: lm-eval's three request types answered in process by
:meth:`tarfa.Model.score`, so the numbers are the ones ``tarfa-run score`` writes.

    pip install ./python lm-eval
    lm_eval run --model tarfa --model_args bundle=PATH,backend=cpu,max_batch=8 --tasks TASK

lm-eval (up to 0.4.13) registers models only by importing them (``@register_model``) and reads
no plugin entry points; the wheel's ``tarfa-lm-eval.pth`` (``_tarfa_lm_eval_hook``) registers
``tarfa.lm_eval:TarfaLM`` lazily when lm-eval's registry module is imported, so the bare
``lm_eval`` finds it. ``python -m tarfa.lm_eval`` (the ``tarfa-lm-eval`` script) is lm-eval's
command line with this module imported first, for a package that is not installed as a wheel.
The ``lm_eval.models`` entry point in pyproject.toml names this class for tools that do look
plugins up. Not imported by ``import tarfa``: lm-eval is needed only here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import tarfa


def _int(name: str, v: Any) -> Optional[int]:
    if v is None or v == "":
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise tarfa.InputError(f"--model_args {name}: expected an integer, got {v!r}") from None


class TarfaLM(LM):
    """``--model_args``: ``bundle`` (required), ``backend`` (auto, cpu, cuda), ``threads``,
    ``ram_budget``, ``vram_budget`` (bytes), ``max_batch`` (requests in flight per engine
    step; never changes a number)."""

    def __init__(
        self,
        bundle: Optional[str] = None,
        backend: str = "auto",
        threads: Any = None,
        ram_budget: Any = None,
        vram_budget: Any = None,
        max_batch: Any = 1,
        **unused: Any,
    ) -> None:
        super().__init__()
        if not bundle:
            raise tarfa.InputError("--model_args: bundle=PATH is required")
        self.model = tarfa.open(
            bundle,
            backend=str(backend),
            threads=_int("threads", threads),
            ram_budget=_int("ram_budget", ram_budget),
            vram_budget=_int("vram_budget", vram_budget),
        )
        self.max_batch = _int("max_batch", max_batch) or 1

    def _score(self, reqs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return self.model.score(reqs, max_batch=self.max_batch) if reqs else []

    def loglikelihood(self, requests: List[Any]) -> List[Tuple[float, bool]]:
        out = self._score(
            [{"context": r.args[0], "continuation": r.args[1]} for r in requests]
        )
        return [(float(o["logprob"]), bool(o["is_greedy"])) for o in out]

    def loglikelihood_rolling(self, requests: List[Any]) -> List[float]:
        return [float(o["logprob"]) for o in self._score([{"rolling": r.args[0]} for r in requests])]

    def generate_until(self, requests: List[Any]) -> List[str]:
        reqs = []
        for r in requests:
            context, kwargs = r.args[0], dict(r.args[1] or {})
            until = kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            req: Dict[str, Any] = {
                "context": context,
                "max_tokens": int(kwargs.get("max_gen_toks", 256)),
                "until": list(until),
            }
            # lm-eval's do_sample=False (or no temperature) is greedy
            temperature = float(kwargs.get("temperature", 0.0) or 0.0)
            if kwargs.get("do_sample", temperature > 0) and temperature > 0:
                req["temperature"] = temperature
                for key in ("top_k", "top_p", "min_p", "seed"):
                    if kwargs.get(key) is not None:
                        req[key] = kwargs[key]
            reqs.append(req)
        return [o["text"] or "" for o in self._score(reqs)]


# Registered once, by the module `tarfa.lm_eval` (under `python -m` this file runs as `__main__`
# first and imports that module below: one class under the name, not two).
if __name__ != "__main__":
    register_model("tarfa")(TarfaLM)


def main() -> None:
    """lm-eval's command line (``lm_eval``'s arguments) with the ``tarfa`` model registered."""
    import tarfa.lm_eval  # noqa: F401  (registers the model)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
