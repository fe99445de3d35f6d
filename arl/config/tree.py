"""The configuration tree: one attrs class per section, `Config` holding them all, and the
dotted keys (``section.field``) that overrides, validation and ``--help`` address them by.

Every field carries ``metadata={"help": ...}``, which `arl.config.files.help_text` prints,
and most a ``"rule"`` on its value (`arl.config.rules`), which validation checks and ``--help``
shows. Plug-in fields (``cluster.launcher``, ``weight_sync.mode``, the engines of the backend
strings) are names checked against their plug-in's registry.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs

from arl.config.errors import ConfigError
from arl.config.rules import (
    BackendString,
    Holds,
    ImportPath,
    OneOf,
    Range,
    Rule,
    at_least_0,
    positive,
    unit,
)

MiB = 2**20

# The checks `Config.validate` runs, ``"types"`` and ``"values"`` (`type_problems` and
# `validation_problems`), set by `arl.config.validate` when it is imported, as `arl.config` does:
# validation reads this tree, so this module does not import it.
CHECKS: dict[str, Callable[["Config"], list[str]]] = {}


def _f(
    default: Any = attrs.NOTHING, help: str = "", *, factory: Any = None, rule: Rule | None = None
) -> Any:
    """An attrs field with its --help text and the rule its value must keep, if any."""
    metadata = {"help": help, "rule": rule}
    if factory is not None:
        return attrs.field(factory=factory, metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def _plain_name(v: str) -> bool:
    return bool(v) and "/" not in v and v not in (".", "..")


_PREFIX = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.?")


def _prefixes(prefixes: list[str]) -> bool:
    return bool(prefixes) and all(_PREFIX.fullmatch(p) for p in prefixes)


_MPS_SHARES = (
    "held to 30% (H200) or 75% (H100) of the SMs the hf engine decoded garbage (NaN "
    "log-probs, every completion at max_new_tokens), and a train rank held to 70% had NaN "
    "gradients in 10 of 40 gsm8k steps; at 50% and 100% both were correct (the cause is not "
    "known)"
)


Norm = Literal["group", "batch", "none"]


@attrs.define(kw_only=True)
class ExperimentConfig:
    """Names the run and where its files go."""

    name: str = _f(
        "arl",
        "experiment name; the run directory is run_dir/name/trial",
        rule=Holds(_plain_name, "must be a plain name"),
    )
    trial: str = _f(
        "trial0",
        "trial name within the experiment",
        rule=Holds(_plain_name, "must be a plain name"),
    )
    run_dir: str = _f("runs", "root directory for runs (config, checkpoints, logs, metrics)")
    overwrite: bool = _f(
        False,
        "replace an earlier run in run_dir/name/trial: its files are moved to "
        "trial.replaced-<UTC time>/ beside it (without this, a finished run there is refused)",
    )
    seed: int = _f(1, "random seed for data order, sampling and initialisation", rule=at_least_0())
    total_train_steps: int = _f(
        3, "number of training steps (policy updates) to run", rule=positive()
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _f("INFO", "logging level")


@attrs.define(kw_only=True)
class ClusterConfig:
    """How node daemons are started and how they reach the controller."""

    launcher: str = _f(
        "local",
        "local: spawn nodes as subprocesses; slurm: start them with srun inside an allocation; "
        "ray: place them as actors on a Ray cluster; attach: wait for externally started nodes "
        "(a program that drives the controller itself builds it: examples/embedded.py)",
        rule=OneOf("arl.control.launchers:LAUNCHERS"),
    )
    n_nodes: int | None = _f(
        None,
        "nodes the run has; must equal the placement plan's count (none: the plan's)",
        rule=positive(),
    )
    controller_host: str = _f("127.0.0.1", "address the controller binds and nodes connect to")
    controller_port: int = _f(
        0,
        "controller port (0: pick a free port)",
        rule=Range(lo=0, hi=65535, text="must be 0..65535"),
    )
    heartbeat_interval: float = _f(1.0, "seconds between heartbeats, both ways", rule=positive())
    heartbeat_timeout: float = _f(
        10.0, "seconds of silence after which a node is lost", rule=positive(inf=True)
    )
    node_start_timeout: float = _f(
        120.0, "seconds to wait for all nodes to say hello", rule=positive(inf=True)
    )
    allowed_import_prefixes: list[str] = _f(
        help="module prefixes a node may import engine objects from",
        factory=lambda: ["arl."],
        rule=Holds(
            _prefixes,
            "needs at least one prefix, each a dotted module name such as arl or myorg.rl",
        ),
    )
    srun_args: list[str] = _f(help="extra arguments for srun (slurm launcher)", factory=list)
    ray_address: str = _f(
        "auto",
        "ray launcher: the cluster; auto (RAY_ADDRESS or the one `ray start` began on this host), "
        "HOST:PORT of its head, ray://HOST:10001 (Ray Client), or local (start one for this run)",
    )
    ray_namespace: str = _f("arl", "ray launcher: Ray namespace of the node actors")
    ray_rollout_cpus: float = _f(
        1.0, "ray launcher: CPUs reserved per rollout node", rule=positive()
    )
    ray_train_cpus: float = _f(1.0, "ray launcher: CPUs reserved per train node", rule=positive())
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _f(
        "PACK", "ray launcher: how nodes spread over Ray hosts (one node's GPUs share a host)"
    )
    ray_placement_timeout: float = _f(
        300.0,
        "ray launcher: seconds to wait for Ray to reserve the nodes' CPUs and GPUs",
        rule=positive(inf=True),
    )
    n_gpus: int | None = _f(
        None,
        "GPUs to place nodes on (none: the GPUs visible on this host, as torch counts them)",
        rule=at_least_0("0: CPU"),
    )
    gpu_memory_gb: float | None = _f(
        None,
        "memory of one GPU in GB (1e9 bytes) that the memory plan fits the parts into (none: "
        "the bytes CUDA can allocate on the device; 80 when no GPU is visible, as when a CPU "
        "machine previews a GPU plan)",
        rule=positive(),
    )
    cpu_threads_per_node: int | None = _f(
        None,
        "torch threads per node process without a GPU (none: a train node takes the host's "
        "cores, a rollout node its share among all the nodes; a GPU node torch's default)",
        rule=positive(),
    )


@attrs.define(kw_only=True)
class TransportConfig:
    """ZeroMQ transport settings: security and message sizes."""

    curve: bool = _f(False, "encrypt all sockets with CURVE (for untrusted networks)")
    secret_file: str = _f(
        "", "0600 file holding the run secret (empty: generated by the launcher, or ARL_SECRET)"
    )
    inline_threshold_bytes: int = _f(
        256, "tensors up to this size travel inside the header", rule=at_least_0()
    )
    max_message_bytes: int = _f(
        2**34,
        "largest message the controller and the nodes accept (a bigger one is refused)",
        rule=positive(),
    )
    pull_chunk_bytes: int = _f(
        MiB,
        "bytes of shard data per message when a node serves a pull (1 MiB measured fastest: "
        "python -m arl.bench rtensor --chunk-mib 1 4 16 64)",
        rule=positive(),
    )
    shared_memory: bool = _f(
        True,
        "nodes keep shards in shared memory and map those of a node on the same host instead "
        "of pulling them over TCP (false: always TCP)",
    )


@attrs.define(kw_only=True)
class RolloutConfig:
    """Inference engines and the asynchronous rollout loop."""

    backend: str = _f(
        "hf:d1",
        "inference backend ENGINE:SPEC, e.g. sglang:d2t2",
        rule=BackendString("rollout"),
    )
    max_concurrent_rollouts: int | None = _f(
        None,
        "prompt groups in flight at once (none: what eta allows, (eta + 1) x data.batch_size)",
        rule=positive(),
    )
    max_head_offpolicyness: int = _f(
        2,
        "eta: how many policy versions older than the trainer a sample may be (0: synchronous)",
        rule=at_least_0("0: synchronous"),
    )
    gpu_sharing: Literal["concurrent", "alternate", "mps", "sleep", "auto"] = _f(
        "concurrent",
        "engines on a train rank's GPU: concurrent generates while the ranks train (the GPU "
        "time-slices between the two processes); alternate pauses their generation in place "
        "for each training step and weight sync, so each phase has the whole GPU (server "
        "engines, which cannot pause in place, abort and re-prefill their requests each step); "
        "mps runs both at once under a private NVIDIA MPS daemon (cluster.launcher=local), the "
        "engine held to rollout.mps_engine_percent of the SMs; sleep is alternate with the "
        "engine's memory given back while the ranks train (KV cache freed, weights dropped; "
        "woken with the synced weights), for a model that does not fit twice; auto is mps "
        "where cluster.launcher=local puts an engine on a train rank's GPU and NVIDIA's MPS "
        "daemon (nvidia-cuda-mps-control) is on PATH and starts, else concurrent",
    )
    mps_engine_percent: int = _f(
        100,
        "with gpu_sharing=mps: the share of the GPU's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) "
        "an engine on a train rank's GPU may use, 50 or 100 (the shares measured to compute "
        "correctly); the train ranks may use all of them",
        rule=Holds(lambda v: v in (50, 100), "must be 50 or 100", note=_MPS_SHARES),
    )
    stale_sample_policy: Literal["keep", "drop"] = _f(
        "keep", "what to do with a finished sample that is staler than eta"
    )
    batch_order: Literal["finished", "submitted"] = _f(
        "finished",
        "which accepted groups a batch takes: the first to finish (a batch waits behind a long "
        "generation only where that keeps every group within eta) or the first submitted "
        "(the loader's order: batches, and a resumed run's, do not depend on timing)",
    )
    workflow: str = _f(
        "arl.workflows.rlvr:RLVRWorkflow",
        "workflow class, module:attribute: arl's RLVRWorkflow or AgentWorkflow, a subclass of "
        "either, or any class with arun_episode (arl.workflows.base)",
        rule=ImportPath(),
    )
    workflow_args: dict[str, Any] = _f(
        help="further keyword arguments of the workflow's constructor, a map such as "
        "{max_turns: 4} (values: str, int, float, bool, none, lists and maps of them)",
        factory=dict,
    )
    reward: str = _f(
        "arl.rewards.gsm8k:gsm8k_reward",
        "reward function, module:attribute: (completion, data) -> float, async def or plain def "
        "(a plain one runs in a thread)",
        rule=ImportPath(called_with=("completion", "data")),
    )
    server_python: str = _f("python", "interpreter that runs vllm/sglang servers")
    server_args: list[str] = _f(help="extra command-line arguments for the server", factory=list)
    server_start_timeout: float = _f(
        600.0, "seconds to wait for an inference server to be healthy", rule=positive(inf=True)
    )
    group_timeout: float | None = _f(
        3600.0,
        "seconds one prompt group (generation and reward) may take; a slower one is cancelled on "
        "its node and counted in rollout/timed_out (none: no limit)",
        rule=positive(inf=True),
    )
    stall_log_s: float | None = _f(
        60.0,
        "with groups in flight and none finished for this many seconds, log which groups are "
        "in flight, on which node, for how long (again every as many seconds; none: never)",
        rule=positive(inf=True),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = _f(
        "auto", "inference weight dtype (auto, bfloat16, float16, float32)"
    )
    hf_decode_attention: Literal["auto", "sdpa", "flex", "triton"] = _f(
        "auto",
        "hf engine decode attention: sdpa reads every row's KV cache up to the batch's longest "
        "row (additive mask); flex and triton read each row's own length, one CUDA graph per "
        "batch bucket: flex is torch flex_attention with a block mask, compiled once per batch "
        "bucket (needs CUDA and torch.compile to be fast: elsewhere torch's unfused reference; "
        "SDPA, with a warning, where it cannot compile); triton is arl's split-KV Triton "
        "kernel, compiled once (CUDA only; flex, with a warning, where it fails); auto is "
        "triton on CUDA, sdpa elsewhere",
    )
    hf_fused_decode: bool = _f(
        True,
        "hf engine: decode Llama-family models (llama, mistral, qwen2, qwen3) through fused "
        "per-layer functions (about half the kernels per step; compiled on CUDA); other models, "
        "and false, decode through the model's own modules",
    )
    hf_overlap: bool = _f(
        True,
        "hf engine on CUDA: launch each decode step before reading the previous one back, so "
        "the host's per-token bookkeeping runs while the GPU computes (a row that finishes costs "
        "one extra step); false reads every step back before the next",
    )
    agent: str = _f(
        "",
        "agent function `async def run(client, data)`, module:attribute (used with "
        "workflow=arl.workflows.agent:AgentWorkflow; the client is OpenAI-shaped)",
        rule=ImportPath(optional=True, called_with=("client", "data")),
    )
    agent_trajectory: Literal["concat", "individual"] = _f(
        "concat",
        "agent workflow: one row per conversation (turns in one sequence, per-token loss mask) "
        "or one row per completion",
    )
    turn_discount: float = _f(
        1.0,
        "agent workflow: reward discount per turn, G_i = r_i + turn_discount * G_(i+1)",
        rule=unit(),
    )
    filter: str = _f(
        "",
        "accept function on finished groups, module:attribute (a GroupReport -> bool), e.g. "
        "arl.filters:nonconstant_reward (DAPO dynamic sampling); empty: accept all",
        rule=ImportPath(optional=True, called_with=("report",)),
    )
    max_consecutive_rejections: int = _f(
        256,
        "this many rejected groups in a row stop the run with an error instead of a hang",
        rule=positive(),
    )


@attrs.define(kw_only=True)
class GenerationConfig:
    """Sampling settings of training rollouts."""

    n_samples: int = _f(4, "completions per prompt (the GRPO group size)", rule=positive())
    max_new_tokens: int = _f(256, "most tokens generated per completion", rule=positive())
    temperature: float = _f(1.0, "sampling temperature (> 0; use greedy for argmax)")
    top_p: float = _f(
        1.0, "nucleus sampling probability mass", rule=Range(lo=0, hi=1, lo_open=True)
    )
    top_k: int = _f(0, "sample among the k most likely tokens (0: off)", rule=at_least_0("0: off"))
    greedy: bool = _f(False, "argmax decoding; overrides temperature, top_p and top_k")
    stop_token_ids: list[int] = _f(
        help="extra token ids that end a completion",
        factory=list,
        rule=Holds(lambda ids: all(t >= 0 for t in ids), "ids must be >= 0"),
    )


@attrs.define(kw_only=True)
class LoraConfig:
    """LoRA adapters on the policy (``rank`` 0: off, the whole model trains)."""

    rank: int = _f(
        0, "adapter rank r (0: no LoRA, a full fine-tune)", rule=at_least_0("0: no LoRA")
    )
    alpha: float = _f(
        32.0, "adapter scale numerator: its output is multiplied by alpha / rank", rule=positive()
    )
    dropout: float = _f(
        0.0, "dropout on an adapter's input while training", rule=unit(hi_open=True)
    )
    target_modules: list[str] = _f(
        help="modules that get adapters, by name suffix (q_proj, ...), or all-linear: every "
        "linear layer of the decoder but the output head",
        factory=lambda: ["all-linear"],
        rule=Holds(lambda m: bool(m) and all(m), "needs module names (q_proj, ...) or all-linear"),
    )


@attrs.define(kw_only=True)
class ActorConfig:
    """The trained policy: model, optimizer and PPO/GRPO loss."""

    backend: str = _f(
        "fsdp:d1", "training backend ENGINE:SPEC, e.g. fsdp:d4", rule=BackendString("train")
    )
    path: str = _f(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "model: a hub id or a local directory",
        rule=Holds(bool, "must name a model"),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = _f(
        "auto", "parameter dtype (auto: bfloat16 on GPU, float32 on CPU)"
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    call_timeout: float | None = _f(
        3600.0,
        "seconds one call on the train ranks (load_batch, compute_logp, ppo_update, save_state, "
        "...) may run; a slower one stops the run naming the node and the call (none: no limit)",
        rule=positive(inf=True),
    )
    lr: float = _f(1.7e-5, "peak learning rate", rule=at_least_0())
    weight_decay: float = _f(0.017, "AdamW weight decay", rule=at_least_0())
    adam_beta1: float = _f(0.9, "AdamW beta1", rule=Range(lo=0, hi=1, hi_open=True))
    adam_beta2: float = _f(0.999, "AdamW beta2", rule=Range(lo=0, hi=1, hi_open=True))
    adam_eps: float = _f(1e-8, "AdamW epsilon", rule=positive())
    lr_scheduler: Literal["constant", "linear", "cosine"] = _f("constant", "LR schedule")
    warmup_steps: int = _f(0, "linear warmup steps", rule=at_least_0())
    min_lr_ratio: float = _f(0.0, "final LR as a fraction of lr (linear and cosine)", rule=unit())
    grad_clip: float = _f(
        1.0, "clip the global gradient norm to this value", rule=positive(inf=True)
    )
    ppo_n_minibatches: int = _f(1, "optimizer steps per training step", rule=positive())
    max_tokens_per_mb: int | None = _f(
        None,
        "token budget of one packed micro-batch (none: sized from free GPU memory; 8192 on CPU)",
        rule=positive(),
    )
    layout: Literal["auto", "packed", "padded"] = _f(
        "auto",
        "micro-batch layout: packed rows with varlen attention (no padding) or padded rows "
        "(auto: packed on CUDA, padded on CPU, where packing would need a dense mask)",
    )
    compile: bool = _f(
        True,
        "torch.compile each decoder layer of the trained model (CUDA; compiled while the "
        "engines start)",
    )
    cuda_graphs: bool = _f(
        True,
        "replay each small packed micro-batch's forward and backward as a CUDA graph, one per "
        "bucket of sizes (one CUDA rank, packed layout, no gradient checkpointing)",
    )
    lora: LoraConfig = attrs.field(
        factory=LoraConfig,
        metadata={"help": "LoRA adapters: only they train and only they are synced"},
    )
    offload: Literal["none", "optimizer"] = _f(
        "none",
        "optimizer: the fp32 master weights and AdamW state live in host memory and the "
        "optimizer steps on the CPU, the gradients streamed there in 1 GiB chunks (a full "
        "fine-tune that does not fit the GPU beside its engine); the GPU keeps the "
        "compute-dtype weights",
    )
    eps_clip: float = _f(0.4, "PPO clip range of the ratio (1 - eps, 1 + eps)", rule=positive())
    eps_clip_higher: float | None = _f(
        None, "upper clip range (none: eps_clip)", rule=positive(inf=True)
    )
    c_clip: float | None = _f(
        None,
        "dual-clip constant c > 1 for negative advantages (none: off)",
        rule=Range(lo=1, lo_open=True, inf=True, note="dual clip needs c > 1"),
    )
    temperature: float = _f(
        1.0, "temperature applied to logits when computing log-probs", rule=positive()
    )
    reward_bias: float = _f(-0.5, "added to the raw reward")
    reward_scaling: float = _f(10.0, "multiplies the biased reward")
    reward_clip: float = _f(
        20.0, "clip the scaled reward to [-clip, clip]", rule=positive(inf=True)
    )
    reward_norm_mean: Norm = _f("group", "subtract the reward mean over the group/batch")
    reward_norm_std: Norm = _f("group", "divide rewards by the std over the group/batch")
    adv_norm_mean: Norm = _f("batch", "subtract the advantage mean over the group/batch")
    adv_norm_std: Norm = _f("batch", "divide advantages by the std over the group/batch")
    norm_eps: float = _f(1e-5, "added to the std before dividing", rule=positive())
    unbiased_std: bool = _f(True, "use the unbiased (n - 1) standard deviation")
    use_decoupled_loss: bool = _f(
        True, "decoupled PPO: ratio against proximal log-probs, weighted by exp(prox - behave)"
    )
    prox_logp: Literal["auto", "pass"] = _f(
        "auto",
        "decoupled loss, proximal log-probs: auto takes them from the update's own forward "
        "(detached) when that is the same computation as a separate pass (one minibatch, no "
        "KL), else runs a no-grad pass before the update; pass always runs the pass",
    )
    behav_imp_weight_cap: float | None = _f(
        5.0, "cap on the behaviour importance weight", rule=positive(inf=True)
    )
    rejection: Literal["none", "token_mask", "seq_mask", "token_clamp"] = _f(
        "none", "rejection sampling of tokens or sequences whose ratio is out of bounds"
    )
    kl_ctl: float = _f(
        0.0, "KL penalty coefficient against the reference model (0: no ref)", rule=at_least_0()
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k1", "KL estimator")
    discount: float = _f(1.0, "GAE discount gamma", rule=unit())
    gae_lambda: float = _f(1.0, "GAE lambda", rule=unit())

    def prox_in_update(self) -> bool:
        """Whether the decoupled loss takes its proximal log-probs from the update's forward.

        With one optimizer step per training step the proximal policy is the one the update
        starts from, and gradient accumulation does not move the weights between micro-batches:
        the update's log-probs, detached, are what a separate pass would compute. More
        minibatches start later ones from moved weights, and KL rewards need the proximal
        log-probs before the advantages, so those keep the pass.
        """
        return (
            self.use_decoupled_loss
            and self.prox_logp == "auto"
            and self.ppo_n_minibatches == 1
            and self.kl_ctl == 0
        )


@attrs.define(kw_only=True)
class RefConfig:
    """The frozen reference model, used only when actor.kl_ctl > 0."""

    path: str = _f("", "reference model (empty: actor.path)")


@attrs.define(kw_only=True)
class DataConfig:
    """The prompt dataset."""

    path: str = _f(
        "openai/gsm8k",
        "a hub dataset id or a local directory of JSONL files",
        rule=Holds(bool, "must name a dataset"),
    )
    loader: str = _f(
        "arl.data.gsm8k:load_gsm8k",
        "import string of (path, split, on_bad_row) -> (rows, stats); rows carry 'messages'",
        rule=ImportPath(called_with=("path", "split", "on_bad_row")),
    )
    train_split: str = _f("train", "split (file stem) used for training")
    eval_split: str = _f("test", "split (file stem) used for evaluation")
    batch_size: int = _f(4, "prompt groups per training step", rule=positive())
    shuffle: bool = _f(True, "shuffle the training prompts each epoch")
    max_prompt_len: int = _f(512, "longest prompt in tokens", rule=positive())
    on_bad_row: Literal["skip", "error"] = _f("skip", "a malformed dataset row is skipped or fatal")
    prompt_overflow: Literal["error", "truncate"] = _f(
        "error", "a prompt over max_prompt_len is an error or is left-truncated"
    )


@attrs.define(kw_only=True)
class WeightSyncConfig:
    """How new weights reach the inference engines."""

    mode: str = _f(
        "auto",
        "auto: by placement (ipc_buffer on train rank 0's GPU, nccl across GPUs, zmq on CPU, "
        "disk for server engines); ipc/ipc_buffer need one shared GPU (arl.weights)",
        rule=OneOf("arl.weights:MODES", extra=("auto",)),
    )
    bucket_bytes: int = _f(256 * MiB, "bytes of parameters sent per bucket", rule=positive())
    in_place: bool = _f(
        True,
        "in-place pause keeps in-flight generations and their KV cache across a sync and "
        "continues them under the new weights (PipelineRL-style in-flight update); false aborts "
        "them and they resume by re-prefilling under the new weights; server engines always abort",
    )
    verify: bool = _f(
        False,
        "after each sync check that every engine holds the trainer's weights: checksums for hf, "
        "for servers the log-probs of a probe sequence (slow; for tests)",
    )
    verify_tolerance: float = _f(
        0.05,
        "verify, server engines: how far the probe's mean log-prob difference per token and its "
        "mean |difference| may move from their values before the first sync (numerics only: "
        "bf16 against fp32 gives a mean |difference| ~0.05 that largely cancels in the mean)",
        rule=positive(),
    )


@attrs.define(kw_only=True)
class SaverConfig:
    """Model checkpoints for use outside arl."""

    freq_steps: int | None = _f(
        None,
        "with hf_export: also save every this many steps (none: only at the end)",
        rule=positive(),
    )
    hf_export: bool = _f(
        True, "save the model in Hugging Face format (save_pretrained) at the end of the run"
    )
    lora_merged: bool = _f(
        False, "with LoRA: also export the merged model (base + adapter) beside the adapter"
    )

    def due(self, step: int) -> bool:
        """Whether to export after ``step`` besides the end: every ``freq_steps`` steps, and
        only with ``hf_export`` (false exports nothing)."""
        return self.hf_export and bool(self.freq_steps) and step % self.freq_steps == 0


@attrs.define(kw_only=True)
class RecoverConfig:
    """Recovery checkpoints for resuming a run (a stop writes one whatever the mode)."""

    mode: Literal["disabled", "auto"] = _f(
        "disabled",
        "auto: checkpoint every freq_steps or freq_secs, resume from the last checkpoint at "
        "start, and restart the run from it when a node is lost or hangs (up to retries times)",
    )
    freq_steps: int | None = _f(
        None,
        "auto: write a recovery checkpoint every this many steps (none: by time only)",
        rule=positive(),
    )
    freq_secs: float | None = _f(
        600.0,
        "auto: write a recovery checkpoint once this many seconds passed since the last "
        "(none: by steps only)",
        rule=positive(),
    )
    retries: int = _f(
        3,
        "auto: restarts after a lost or hung node before the launcher gives up",
        rule=at_least_0("0: never restart"),
    )
    stop_grace_s: float = _f(
        60.0,
        "on SIGTERM or a first Ctrl-C: seconds to finish the step and write the stop's "
        "checkpoint before the run is ended without it (size Slurm's --signal=TERM@N above it)",
        rule=positive(),
    )


@attrs.define(kw_only=True)
class EvaluatorConfig:
    """Periodic evaluation on data.eval_split."""

    freq_steps: int | None = _f(
        None,
        "evaluate every this many steps and after the last step (none: never)",
        rule=positive(),
    )
    n_samples: int = _f(1, "completions per evaluation question", rule=positive())
    temperature: float = _f(
        0.0, "evaluation sampling temperature (0: greedy)", rule=at_least_0("0: greedy")
    )
    max_questions: int | None = _f(
        64, "evaluate on at most this many questions (none: all)", rule=positive()
    )

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to evaluate after ``step`` of ``total_steps``: every ``freq_steps`` steps,
        and after the last one, so a run always ends with the trained policy's accuracy."""
        return bool(self.freq_steps) and (step % self.freq_steps == 0 or step == total_steps)


@attrs.define(kw_only=True)
class StatsConfig:
    """Where metrics go."""

    tensorboard: bool = _f(True, "write TensorBoard events to the run directory")
    jsonl: bool = _f(True, "write one JSON line of metrics per step")
    progress_bar: bool = _f(True, "show a progress bar on the terminal")
    trace: bool = _f(
        True, "write trace.json, a timeline of the run (Chrome trace JSON; opens in Perfetto)"
    )


def _section(cls: type, help: str) -> Any:
    return attrs.field(factory=cls, metadata={"help": help})


@attrs.define(kw_only=True)
class Config:
    """The whole configuration of one run."""

    experiment: ExperimentConfig = _section(ExperimentConfig, "run name, seed and length")
    cluster: ClusterConfig = _section(ClusterConfig, "node processes and the controller")
    transport: TransportConfig = _section(TransportConfig, "ZeroMQ transport")
    rollout: RolloutConfig = _section(RolloutConfig, "inference engines and async rollout")
    gconfig: GenerationConfig = _section(GenerationConfig, "sampling of training rollouts")
    actor: ActorConfig = _section(ActorConfig, "the trained policy and its loss")
    ref: RefConfig = _section(RefConfig, "the reference model for the KL penalty")
    data: DataConfig = _section(DataConfig, "the prompt dataset")
    weight_sync: WeightSyncConfig = _section(WeightSyncConfig, "weight updates to inference")
    saver: SaverConfig = _section(SaverConfig, "model checkpoints")
    recover: RecoverConfig = _section(RecoverConfig, "recovery checkpoints")
    evaluator: EvaluatorConfig = _section(EvaluatorConfig, "periodic evaluation")
    stats: StatsConfig = _section(StatsConfig, "metrics output")

    @property
    def run_path(self) -> Path:
        """The run directory: run_dir/name/trial (``~`` is the home folder: a shell leaves
        it as it is in ``experiment.run_dir=~/runs``)."""
        e = self.experiment
        return Path(e.run_dir).expanduser() / e.name / e.trial

    @property
    def ref_path(self) -> str:
        """The reference model path (ref.path, or actor.path when empty)."""
        return self.ref.path or self.actor.path

    @property
    def max_concurrent_rollouts(self) -> int:
        """Prompt groups in flight at once, with the default resolved: as many as the staleness
        bound lets run, so that eta, not a second cap, limits rollout. With a cap of 2 x batch a
        rollout-bound gsm8k run admitted one group per finished group, one eager prefill each
        (106 in 8 steps, stalling every decoding row); uncapped, groups are admitted 64 at a
        version bump (19 prefills), and a decode step fell from 13.3 to 10.3 ms on an H200."""
        eta = self.rollout.max_head_offpolicyness
        return self.rollout.max_concurrent_rollouts or (eta + 1) * self.data.batch_size

    def validate(self) -> None:
        """Check every field and the relations between them; raise one `ConfigError` listing all.

        Types come first (a recipe assigns fields directly, past the override parser): with any
        field of the wrong type only the type problems are listed, as the value checks need them.
        """
        _raise(CHECKS["types"](self) or CHECKS["values"](self))

    def validate_types(self) -> None:
        """Check only that every field has its annotated type (`type_problems`); raise one
        `ConfigError` listing every one that does not."""
        _raise(CHECKS["types"](self))


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def field_keys() -> dict[str, attrs.Attribute]:
    """Every settable dotted key, ``section.field`` (``section.sub.field`` inside a nested
    section such as ``actor.lora``), mapped to its attrs field."""
    keys = {}
    for section in attrs.fields(Config):
        keys.update(_leaf_fields(section.type, section.name))
    return keys


def _leaf_fields(cls: type, prefix: str) -> dict[str, attrs.Attribute]:
    out = {}
    for field in attrs.fields(cls):
        key = f"{prefix}.{field.name}"
        if attrs.has(field.type):
            out.update(_leaf_fields(field.type, key))
        else:
            out[key] = field
    return out


def get_key(cfg: Config, key: str) -> Any:
    """The value at a dotted key such as ``actor.lr`` or ``actor.lora.rank``."""
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value
