"""The model section of the config: which model, in which dtype, and how the built-in tiny model is
warm-started (`model.tiny`; asyncrl/tiny/build.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.section import _Section


class TinyModelConfig(_Section):
    """How `builtin:tiny` is warm-started (asyncrl/tiny/build.py); each setting is part of the cache
    key, so a change builds a new model once (tens of seconds) and reuses it afterwards."""

    target_sampled_accuracy: float | None = Field(0.25, gt=0, lt=1)
    """Supervised training stops when the accuracy of sampling (temperature 1, whole vocabulary,
    as rollouts sample) on the train problems reaches this: RL starts from a partially trained
    policy. None: train all warm_start_steps, to convergence."""
    warm_start_steps: int = Field(800, gt=0)
    """Length of the supervised learning-rate schedule and the most steps trained."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate of the supervised warm start."""
    soften_to_probability: float | None = Field(None, gt=0, lt=1)
    """Optional, off by default: after training, bake a temperature into the weights so that the
    exact probability of sampling the right answer is this. Use it with target_sampled_accuracy=null
    (a converged model): RL then mostly undoes the temperature, and its entropy falls by the same
    rescaling, so entropy studies on such a model measure that artefact."""
    seed: int = 0
    """Seeds the tiny model's init, its warm-start batches and accuracy samples."""
    task: Literal["arith", "calc_tool"] = "arith"
    """What the warm start teaches: arith (single-digit addition, data.type tiny_arith) or calc_tool
    (two-digit multiplication through the calculator tool, data.type tiny_calc with env.type
    calculator: copy the operands into `<calc>a*b</calc>`, then the result into the box)."""
    num_experts: int = Field(0, ge=0, le=254)
    """0: a dense model (Qwen2). More: a mixture-of-experts model (Qwen3-MoE, the architecture of
    Qwen3-30B-A3B) whose every layer routes each token to `experts_per_token` of this many experts."""
    experts_per_token: int = Field(2, gt=0)
    """Experts each token is routed to, per layer (with num_experts > 0)."""
    architecture: Literal["qwen2", "llama"] = "qwen2"
    """The dense model's architecture. llama: the qwen2 model's own weights (its query, key and value
    biases kept by Llama's attention_bias, the output projection's bias zero) under Llama's
    architecture, the same function to the last bit; vLLM serves LoRA adapters on the embedding and
    the LM head of a Llama model, and of a Qwen2 one on its decoder's linear layers only
    (configs/tiny_lora.yaml)."""

    @model_validator(mode="after")
    def _dense_twin(self) -> "TinyModelConfig":
        if self.architecture == "llama" and (self.num_experts or self.task != "arith"):
            raise ValueError("model.tiny.architecture=llama is the dense arithmetic model's twin: "
                             "with num_experts=0 and task=arith only")
        return self


class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """Hugging Face model directory, or `builtin:tiny` for the locally built tiny model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """The warm start of `builtin:tiny` (ignored for any other model.path)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype: engine weights and learner forwards (autocast over learner.param_dtype masters)."""
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt + response, in tokens (None: the model's own context length, read from its
    config.json before anything starts; a larger value is an error)."""
