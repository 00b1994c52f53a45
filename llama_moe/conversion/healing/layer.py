"""The layer healer: after a layer is converted, train its MoE MLP to reproduce the dense layer's MLP output.

A training-free split loses what the experts a token skips would have added. Healing trains each MoE MLP block (its
router, routed experts, shared experts and compensation) on calibration tokens, one layer at a time, in order:

    h_0 = embed(tokens)                                   [N, S, H] calibration sequences
    for each layer i:
        a_i = h_i + attention_i(norm(h_i))                the converted model's attention (dense, or AttnMoE's)
        x_i = post_attention_norm(a_i)                    the MLP input the converted model really sees
        y_i = dense_mlp_i(x_i)                            target "mlp"
            = d_{i+1} - a_i                               target "stream": d is the dense model's own states
        train block_i to minimise  |block_i(x_i) - y_i|^2 / mean |y_i|^2
                                   + routing_weight * listwise(router_i(x_i), energy_i(x_i))
        h_{i+1} = a_i + block_i(x_i)

so each layer learns on the inputs the already-healed earlier layers give it and errors do not pile up (sequential,
as in layer-wise pruning). The "stream" target goes further: each MLP learns to bring the hidden states back to the
dense model's, undoing what the earlier layers (and the attention that read their states) left wrong; it needs the
converted attention to be the dense one (the plan refuses it for attention experts).

`energy_i[t, e] = |expert_e(x_t) - compensation_e|^2` is what token t loses when expert e is left out (G-MoEfication's
deviation energy with the current weights): the routing term pulls the router's top-k towards the experts whose
removal costs most (`gmoefication.selector_loss`, the selector's own objective).

The block is trained as it runs in inference (top-k routing, no router noise) with Adam, the same seed per layer:
the result is deterministic on CPU. One decoder layer is in memory at a time, next to the calibration states
(`tokens x hidden x 4` bytes, 75 MB for 32768 tokens of SmolLM2). With a `state_dir`, every healed layer and the states
after it are saved, so an interrupted run resumes at the next layer.
"""

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...devices import default_device

logger = logging.getLogger(__name__)

STATE_FILE = "healing.json"


@dataclass(frozen=True)
class HealSettings:
    """The recipe's `heal_*` fields (their defaults and help live there) and its seed."""

    tokens: int  # calibration tokens (whole sequences)
    epochs: int
    lr: float
    batch_tokens: int
    routing_weight: float
    seed: int
    schedule: str
    target: str  # "stream" or "mlp": the recipe's, after `resolve_recipe` chose it for the family

    @classmethod
    def from_recipe(cls, recipe) -> "HealSettings":
        r = recipe
        if r.heal_target is None:
            raise ValueError("The recipe's heal_target is unset: pass the recipe through resolve_recipe first.")
        fields = (r.heal_tokens, r.heal_epochs, r.heal_lr, r.heal_batch_tokens, r.heal_routing_weight, r.seed)
        return cls(*fields, r.heal_schedule, r.heal_target)


class LayerHealer:
    """Heals the MoE MLP blocks of a converted model layer after layer (`heal`), carrying the calibration states.

    config: the converted model's config. layer_class / rotary_class: its decoder layer and rotary embedding classes.
    embed_weight: `[V, H]` input embeddings. input_ids: `[N, S]` calibration tokens.
    """

    def __init__(
        self, settings, config, layer_class, rotary_class, embed_weight, input_ids, device, state_dir=None, identity=""
    ):
        self.settings, self.config, self.layer_class = settings, _standalone(config), layer_class
        self.device = torch.device(device)
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.identity = identity  # what else the healed weights depend on (source, method...), for resuming
        positions = torch.arange(input_ids.shape[1], device=self.device)[None]
        self.hidden = F.embedding(input_ids.to(self.device), embed_weight.to(self.device, torch.float32))
        self.dense_hidden = self.hidden.clone() if settings.target == "stream" else None  # the dense model's states
        rotary = rotary_class(config=self.config).to(self.device)
        self.position_embeddings = rotary(self.hidden[:1], positions)
        self.errors: dict[int, tuple[float, float]] = {}  # layer -> relative MLP error (before, after)
        self.runs: dict[int, tuple[str, int]] = {}  # layer -> (device, threads) it was healed under
        self.done = self._resume(input_ids) if self.state_dir is not None else -1

    @classmethod
    def for_model(cls, recipe, model, embed_weight, input_ids, device=None, state_dir=None, identity=""):
        """The healer of `recipe`'s healing for `model` (the converted model, on any device, meta included), on
        `device` (None: CUDA when available, else CPU)."""
        device = device or default_device()
        layer_class, rotary_class = type(model.model.layers[0]), type(model.model.rotary_emb)
        settings = HealSettings.from_recipe(recipe)
        return cls(
            settings, model.config, layer_class, rotary_class, embed_weight, input_ids, device, state_dir, identity
        )

    def heal(self, layer_idx: int, tensors: dict, dense: dict) -> dict:
        """The layer's tensors (keyed under the layer) with its MoE MLP healed; the states moved past the layer.
        dense: the source layer's tensors in LLaMA's layout (`mlp.*` only for the "mlp" target)."""
        if layer_idx <= self.done:
            return {**tensors, **_load_layer(self.state_dir, layer_idx)}
        layer = self._layer(layer_idx, tensors)
        self.runs[layer_idx] = (str(self.device), torch.get_num_threads())
        with torch.no_grad():
            attended = self._attend(layer, self.hidden)
            inputs = layer.post_attention_layernorm(attended).flatten(0, 1)  # [T, H]
            targets = self._targets(layer, inputs, attended, dense)
        start = {k[len("mlp.") :]: v for k, v in tensors.items() if k.startswith("mlp.")}  # what the block loaded
        outputs = (
            self._train(layer_idx, layer.mlp, inputs, targets, start)
            if _is_moe(layer.mlp)
            else _batched(layer.mlp, inputs)
        )
        self.hidden = attended + outputs.view_as(attended)
        healed = {f"mlp.{k}": v.detach().cpu() for k, v in layer.mlp.state_dict().items()}
        if self.state_dir is not None:
            self._save(layer_idx, healed)
        return {**tensors, **healed}

    def _train(self, layer_idx: int, block, inputs: torch.Tensor, targets: torch.Tensor, start: dict) -> torch.Tensor:
        """Train the MoE block and record its relative error before and after; its outputs on `inputs` (`[T, H]`).
        start: the tensors the block was loaded from, which it goes back to where training made it worse (loading
        them again gives the same float32 weights, without a copy of the block held through training)."""
        before = _relative_error(_batched(block, inputs), targets)
        _train_block(block, inputs, targets, self.settings, layer_idx)
        outputs = _batched(block, inputs)
        after = _relative_error(outputs, targets)
        if after > before:  # a step too large for this layer (few tokens): healing never makes a layer worse
            block.load_state_dict(start)
            outputs, after = _batched(block, inputs), before
        self.errors[layer_idx] = (before, after)
        return outputs

    def info(self) -> dict:
        """What healing did: its settings, the mean relative MLP error before and after it, and the layers that kept
        their weights because training made them worse (their error is unchanged)."""
        # Sums split over another thread count or device round differently, and training grows that last bit (0.27 at
        # most in SmolLM2's weights, 1 thread against 2), so the run's own decide the bytes as much as the settings.
        # A resumed run may have healed its first layers under others: then each is listed per layer.
        runs = [self.runs[layer] for layer in sorted(self.runs)] or [(str(self.device), torch.get_num_threads())]
        info = {"healing": asdict(self.settings)}
        for name, values in zip(("device", "threads"), zip(*runs)):
            info["healing"][name] = values[0] if len(set(values)) == 1 else list(values)
        if self.errors:
            before, after = zip(*self.errors.values())
            info["healing"].update(error_before=round(sum(before) / len(before), 4))
            info["healing"].update(error_after=round(sum(after) / len(after), 4))
            info["healing"].update(kept_layers=sorted(layer for layer, (b, a) in self.errors.items() if a == b))
        return info

    def _layer(self, layer_idx: int, tensors: dict):
        layer = self.layer_class(self.config, layer_idx).to(self.device, torch.float32)
        layer.load_state_dict({k: v.to(self.device, torch.float32) for k, v in tensors.items()})
        return layer.eval().requires_grad_(False)

    @torch.no_grad()
    def _targets(self, layer, inputs, attended, dense: dict) -> torch.Tensor:
        """`[T, H]`: what the layer's MLP should add to `attended` (the settings' target; None for a dense MLP under the
        mlp target, which has nothing to learn); the dense states move on."""
        if self.dense_hidden is None:
            return _swiglu(inputs, dense, self.config.hidden_act) if _is_moe(layer.mlp) else None
        dense_attended = self._attend(layer, self.dense_hidden)
        dense_inputs = layer.post_attention_layernorm(dense_attended).flatten(0, 1)
        self.dense_hidden = dense_attended + _swiglu(dense_inputs, dense, self.config.hidden_act).view_as(attended)
        return (self.dense_hidden - attended).flatten(0, 1)

    @torch.no_grad()
    def _attend(self, layer, hidden: torch.Tensor) -> torch.Tensor:
        """`h + attention(norm(h))` for every calibration sequence (causal: the sequences hold no padding)."""
        outputs = []
        for states in hidden.split(16):
            cos, sin = (t.expand(states.shape[0], -1, -1) for t in self.position_embeddings)
            normed = layer.input_layernorm(states)
            outputs.append(states + layer.self_attn(normed, position_embeddings=(cos, sin), attention_mask=None)[0])
        return torch.cat(outputs)

    # Resuming ----------------------------------------------------------------------------------------------------

    def _fingerprint(self, input_ids) -> str:
        from llama_moe_hf import __version__  # layers healed by another release's code are not mixed with this one's

        digest = hashlib.sha256(json.dumps(asdict(self.settings), sort_keys=True).encode())
        digest.update(__version__.encode())
        digest.update(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
        digest.update(self.identity.encode())
        digest.update(input_ids.numpy().tobytes())
        return digest.hexdigest()

    def _resume(self, input_ids) -> int:
        """The last layer a previous run of the same healing finished (-1: none), its states loaded."""
        from safetensors.torch import load_file

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._key = self._fingerprint(input_ids)
        path = self.state_dir / STATE_FILE
        state = json.loads(path.read_text()) if path.is_file() else {}
        if state.get("fingerprint") != self._key:
            return -1
        states = load_file(self.state_dir / f"hidden_{state['layer']}.safetensors", device=str(self.device))
        self.hidden, self.dense_hidden = states["hidden"], states.get("dense")
        self.errors = {int(k): tuple(v) for k, v in state["errors"].items()}
        self.runs = {int(k): tuple(v) for k, v in state.get("runs", {}).items()}
        logger.info("Healing resumes after layer %d (%s).", state["layer"], self.state_dir)
        return state["layer"]

    def _save(self, layer_idx: int, healed: dict) -> None:
        """The healed layer and the states after it, then the record naming the layer (each write atomic), then the
        states before it removed: whenever the run stops, the record names a layer whose files are all there."""
        from safetensors.torch import save_file

        from ...checkpoints.atomic import atomic_file

        with atomic_file(self.state_dir / f"layer_{layer_idx}.safetensors") as tmp:
            save_file(healed, str(tmp))
        states = {"hidden": self.hidden.cpu()}
        if self.dense_hidden is not None:
            states["dense"] = self.dense_hidden.cpu()
        with atomic_file(self.state_dir / f"hidden_{layer_idx}.safetensors") as tmp:
            save_file(states, str(tmp))
        record = {"fingerprint": self._key, "layer": layer_idx, "errors": self.errors, "runs": self.runs}
        with atomic_file(self.state_dir / STATE_FILE) as tmp:
            tmp.write_text(json.dumps(record))
        (self.state_dir / f"hidden_{layer_idx - 1}.safetensors").unlink(missing_ok=True)


def state_dir_for(output: Path) -> Path:
    """Where healing keeps its per-layer progress until `output` is written: beside it, hidden."""
    output = Path(output).expanduser().resolve()
    return output.with_name(f".{output.name}.healing")


def _train_block(block, inputs: torch.Tensor, targets: torch.Tensor, settings: HealSettings, layer_idx: int) -> None:
    """Adam on every parameter of the MoE block, in mini-batches of `batch_tokens` tokens, `epochs` passes, the
    learning rate following `schedule` over the layer's steps."""
    from transformers import get_scheduler

    from ..routers.selector.gmoefication import selector_loss

    block.requires_grad_(True)
    # One fused kernel for the whole Adam update where torch has one (CPU and CUDA)
    fused = next(block.parameters()).device.type in ("cpu", "cuda")
    optimizer = torch.optim.Adam(block.parameters(), lr=settings.lr, fused=fused)
    steps = settings.epochs * -(-inputs.shape[0] // settings.batch_tokens)
    scheduler = get_scheduler(settings.schedule, optimizer, num_warmup_steps=0, num_training_steps=steps)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + layer_idx)
    scale = targets.pow(2).mean()
    for _ in range(settings.epochs):
        for index in torch.randperm(inputs.shape[0], generator=generator).split(settings.batch_tokens):
            index = index.to(inputs.device)
            states, wanted = inputs[index], targets[index]
            loss = (block(states[None])[0] - wanted).pow(2).mean() / scale
            if settings.routing_weight:
                loss = loss + settings.routing_weight * selector_loss(block.gate.logits(states), _energy(block, states))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    block.requires_grad_(False)


@torch.no_grad()
def _energy(block, states: torch.Tensor) -> torch.Tensor:
    """`[T, E]`: what each token loses when each expert is left out (its output against its compensation)."""
    from ..routers.selector.gmoefication import deviation_energy

    experts = block.experts
    zero_mean = experts.down_proj.new_zeros(experts.num_experts, experts.intermediate_dim)
    return deviation_energy(states, experts.gate_up_proj, experts.down_proj, zero_mean, block.compensation)


def _relative_error(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return ((outputs - targets).pow(2).mean() / targets.pow(2).mean()).item()


@torch.no_grad()
def _batched(mlp, inputs: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    return torch.cat([mlp(chunk[None])[0] for chunk in inputs.split(rows)])


def _swiglu(inputs: torch.Tensor, dense_mlp: dict, activation: str) -> torch.Tensor:
    """The dense MLP's output (`mlp.gate_proj` etc. of the source layer) on `[T, H]` inputs, in chunks."""
    from transformers.activations import ACT2FN

    from llama_moe_hf.modeling.moe_kernels import swiglu

    act = ACT2FN[activation]
    gate, up, down = (dense_mlp[f"mlp.{n}_proj.weight"].to(inputs) for n in ("gate", "up", "down"))
    # two products, as the dense model computes them (one on the concatenated weights would round differently)
    pre = (torch.cat([F.linear(x, gate), F.linear(x, up)], dim=-1) for x in inputs.split(8192))
    return torch.cat([F.linear(swiglu(p, act), down) for p in pre])


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def _standalone(config):
    """A copy of the config for layers built outside a model: attention through sdpa (the calibration sequences are
    whole and causal), the experts through the family's default dispatch (what a loaded model would pick)."""
    config = type(config).from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    config._experts_implementation = "llama_moe_auto"
    return config


def _load_layer(state_dir: Path, layer_idx: int) -> dict:
    from safetensors.torch import load_file

    return load_file(state_dir / f"layer_{layer_idx}.safetensors")
