"""SGLang 0.5.23's elastic-EP expert backup on our WeightBackupManager, end to end on CPU.

Everything here is real except the model: the holder is our replacement of
``run_expert_backup_manager`` called through the engine's own name, in a spawned process
that reads a tiny DeepSeek-V3 checkpoint through SGLang's own loader; the client is our
replacement of ``ExpertBackupClient`` built through the model runner's name, with SGLang's
``ModelConfig``, ``ExpertLocationMetadata`` (redundant replicas) and DeepSeek's own weight
name filter; bytes move over a real Mooncake TransferEngine on loopback TCP and, after the
holder is killed, from a real Mooncake Store. The model is a module holding DeepSeek's
fused expert parameters on the CPU (a real DeepSeek model cannot be built without CUDA).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.mooncake import LOOPBACK, MooncakeCluster, free_port, mooncake_master_path

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(mooncake_master_path() is None, reason="Mooncake is not installed"),
]

HIDDEN, INTER, EXPERTS, LAYERS, REDUNDANT = 16, 8, 4, 2, 2
PHYSICAL = [0, 1, 2, 3, 1, 2]  # physical slot -> logical expert: experts 1 and 2 twice
SENTINEL = 7.0
PROJECTIONS = {
    "gate_proj": (INTER, HIDDEN),
    "up_proj": (INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
}
READY_S = 60.0


def write_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 checkpoint: 2 MoE layers and an MTP layer (layer 2), 4 experts each."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": 32,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "kv_lora_rank": 8,
        "q_lora_rank": None,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 4,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(23)
    tensors = {"model.layers.0.self_attn.o_proj.weight": torch.randn(HIDDEN, 8)}
    for layer in range(LAYERS + 1):
        for expert in range(EXPERTS):
            for projection, shape in PROJECTIONS.items():
                name = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
                tensors[name] = torch.randn(shape, generator=generator).to(torch.bfloat16)
    save_file(tensors, str(root / "model.safetensors"))
    return tensors


def server_args(
    model: Path, *, backend: str, options: dict[str, object], managers: list[str]
) -> Any:
    """ServerArgs for elastic EP with the expert backup, as the flags leave them."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    extra = {
        "backend_name": "sglang_storage",
        "module_path": "sglang_storage_adapters.hicache_storage",
        "class_name": "HiCacheBackend",
        "storage_backend": backend,
        "storage_options": options,
        "storage_managers": managers,
    }
    args = ServerArgs(
        model_path=str(model),
        load_format="safetensors",
        device="cpu",
        enable_elastic_expert_backup=True,
        elastic_ep_backend="mooncake",
        ep_num_redundant_experts=REDUNDANT,
        enable_hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    set_global_server_args_for_scheduler(args)
    return args


def fused_model() -> torch.nn.Module:
    """DeepSeek's fused expert parameters per MoE layer (all physical slots), sentinel-filled."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        slots = len(PHYSICAL)
        for name, shape in (
            ("w13_weight", (slots, 2 * INTER, HIDDEN)),
            ("w2_weight", (slots, HIDDEN, INTER)),
        ):
            full = torch.full(shape, SENTINEL, dtype=torch.bfloat16)
            layer.mlp.experts.register_parameter(
                name, torch.nn.Parameter(full, requires_grad=False)
            )
        layers.append(layer)
    model.model.layers = layers
    return model


def slot(model: torch.nn.Module, layer: int, physical: int) -> dict[str, torch.Tensor]:
    experts = model.model.layers[layer].mlp.experts  # type: ignore[index, union-attr]
    w13, w2 = experts.w13_weight.data[physical], experts.w2_weight.data[physical]
    return {"gate_proj": w13[:INTER], "up_proj": w13[INTER:], "down_proj": w2}


def holds(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], layer: int, physical: int
) -> bool:
    """Whether physical slot ``physical`` holds its logical expert's checkpoint bytes."""
    expert = PHYSICAL[physical]
    return all(
        torch.equal(
            view.view(torch.int16),
            tensors[f"model.layers.{layer}.mlp.experts.{expert}.{p}.weight"].view(torch.int16),
        )
        for p, view in slot(model, layer, physical).items()
    )


def untouched(model: torch.nn.Module, layer: int, physical: int) -> bool:
    return all(bool((view == SENTINEL).all()) for view in slot(model, layer, physical).values())


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Our adapter installed through SGLang's HookRegistry; SGLang's bindings restored after."""
    from sglang.srt.elastic_ep import expert_backup_client, expert_backup_manager
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_storage_adapters import elastic_ep

    originals = (
        expert_backup_manager.run_expert_backup_manager,
        expert_backup_client.ExpertBackupClient,
    )
    saved = ({k: list(v) for k, v in HookRegistry._hooks.items()}, set(HookRegistry._patched))
    bound = [
        (module, name, value)
        for module in list(sys.modules.values())
        if module is not elastic_ep
        for name, value in list(vars(module).items())
        if any(value is original for original in originals)
    ]
    elastic_ep.install()
    HookRegistry.apply_hooks()
    try:
        yield
    finally:
        for module, name, value in bound:
            setattr(module, name, value)
        HookRegistry.reset()
        HookRegistry._hooks.update(saved[0])
        HookRegistry._patched.update(saved[1])


def bind_port_pair(first: Any, second: Any, attempts: int = 20) -> int:
    """Bind two zmq sockets to a free port and the next one; returns the first port.

    A port found free can be taken by another process before it is bound, and the next
    port may not be free at all: such a pair is given up and another one tried.
    """
    import zmq

    for _ in range(attempts):
        base = free_port()
        try:
            first.bind(f"tcp://{LOOPBACK}:{base}")
        except zmq.ZMQError:
            continue
        try:
            second.bind(f"tcp://{LOOPBACK}:{base + 1}")
        except zmq.ZMQError:
            first.unbind(f"tcp://{LOOPBACK}:{base}")
            continue
        return base
    raise AssertionError(f"no two free consecutive ports on {LOOPBACK} in {attempts} tries")


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake and SGLang on 127.0.0.1 only, the holder's port free (inherited by children)."""
    monkeypatch.setenv("SGLANG_BACKUP_PORT_BASE", str(free_port()))
    monkeypatch.setenv("SGLANG_HOST_IP", LOOPBACK)
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", LOOPBACK)


@contextlib.contextmanager
def as_rank() -> Iterator[None]:
    """This process as EP rank 0 of one node (server args published): a gloo world,
    SGLang's TransferEngine and an expert location with redundant replicas."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        _compute_logical_to_all_physical_map,
    )
    from sglang.srt.runtime_context import get_parallel, get_resources, reset_context

    init_mooncake_transfer_engine(hostname=LOOPBACK)
    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", rank=0, world_size=1
        )
    physical = torch.tensor([PHYSICAL] * LAYERS)
    metadata = ExpertLocationMetadata._init_raw(
        ep_size=1,
        physical_to_logical_map=physical,
        logical_to_all_physical_map=_compute_logical_to_all_physical_map(
            physical_to_logical_map=physical, num_logical_experts=EXPERTS, ep_size=1, moe_ep_rank=0
        ),
        moe_ep_rank=0,
    )
    world = types.SimpleNamespace(
        cpu_group=torch.distributed.group.WORLD
    )  # SGLang's WORLD coordinator's gloo group
    try:
        with get_parallel().override(moe_ep_rank=0, world_group=world):
            get_resources().expert_location_metadata = metadata
            yield
    finally:
        get_resources().expert_location_metadata = None
        reset_context()
        if created:
            torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_filtered_restore_is_byte_exact_across_processes_and_falls_back_to_the_store(
    tmp_path: Path, loopback: None
) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.deepseek_common.deepseek_weight_loader import DeepseekV2WeightLoaderMixin
    from sglang_storage_adapters.elastic_ep import StorageExpertBackupClient

    from sglang_storage.errors import StateError
    from sglang_storage.managers.weights import RestoreState

    tensors = write_checkpoint(tmp_path / "model")
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(MooncakeCluster(tmp_path))
        stack.enter_context(installed())
        from sglang.srt.entrypoints import engine
        from sglang.srt.model_executor import model_runner

        args = server_args(
            tmp_path / "model", backend="mooncake", options=cluster.options(), managers=["weights"]
        )
        model = fused_model()
        stack.enter_context(as_rank())
        # The client first: SGLang's model runner builds it after loading the model.
        client = model_runner.ExpertBackupClient(
            model_config=ModelConfig.from_server_args(args), get_model=lambda: model
        )
        holder: multiprocessing.process.BaseProcess | None = None
        try:
            assert type(client) is StorageExpertBackupClient
            assert client.use_backup is False  # no holder yet: EPLB reloads from disk
            with pytest.raises(StateError, match="not in use yet"):
                client.update_weights()
            started = time.monotonic()
            holder = engine.run_expert_backup_manager(args, None)
            assert isinstance(holder, multiprocessing.process.BaseProcess)
            assert client.wait_ready(READY_S), client.error
            ready_s = time.monotonic() - started

            # EPLB lost layer 0's expert 1 (two replicas: slots 1 and 4) and layer 1's expert 3.
            lost = DeepseekV2WeightLoaderMixin.generate_weight_name_filter({0: [1], 1: [3]})
            t0 = time.monotonic()
            client.update_weights(lost)
            print(f"peer restore {time.monotonic() - t0:.3f} s")
            assert set(client.last_restore.values()) == {RestoreState.PEER}  # TransferEngine
            for layer in range(LAYERS):
                for physical in range(len(PHYSICAL)):
                    restored = (layer, PHYSICAL[physical]) in {(0, 1), (1, 3)}
                    assert (
                        holds(model, tensors, layer, physical)
                        if restored
                        else untouched(model, layer, physical)
                    ), (layer, physical)

            # The node's holder dies; every expert comes back from the shared store.
            holder.kill()
            holder.join(timeout=10)
            t0 = time.monotonic()
            client.update_weights()
            print(f"store restore {time.monotonic() - t0:.1f} s")
            assert set(client.last_restore.values()) == {RestoreState.PENDING}  # from storage
            assert len(client.last_restore) == LAYERS * EXPERTS  # not the MTP layer's
            assert all(
                holds(model, tensors, layer, p)
                for layer in range(LAYERS)
                for p in range(len(PHYSICAL))
            )
            print(f"holder ready in {ready_s:.1f} s")
        finally:
            t0 = time.monotonic()
            client.close()
            print(f"close {time.monotonic() - t0:.1f} s")
            if holder is not None and holder.is_alive():
                holder.kill()
                holder.join(timeout=10)


@pytest.mark.timeout(60)
def test_without_weights_in_the_managers_sglang_builds_and_runs_its_own_client(
    tmp_path: Path, loopback: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's client, through the model runner's name, against SGLang's PULL/PUB protocol."""
    import zmq
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.elastic_ep import expert_backup_client
    from sglang.srt.elastic_ep.expert_backup_client import ExpertBackupClient
    from sglang.srt.managers.io_struct import BackupDramReq, sock_recv, sock_send

    write_checkpoint(tmp_path / "model")
    context = zmq.Context()
    with contextlib.ExitStack() as stack:
        stack.callback(context.destroy, linger=0)  # also when a bind fails
        pull, pub = context.socket(zmq.PULL), context.socket(zmq.PUB)
        base = bind_port_pair(pull, pub)
        # SGLang's client reads the port base once, when its module is first imported.
        monkeypatch.setattr(expert_backup_client, "PORT_BASE", base)
        monkeypatch.setenv("SGLANG_BACKUP_PORT_BASE", str(base))
        stack.enter_context(installed())
        from sglang.srt.model_executor import model_runner

        args = server_args(tmp_path / "model", backend="memory", options={}, managers=["kv"])
        stack.enter_context(as_rank())
        model = fused_model()
        client = model_runner.ExpertBackupClient(
            model_config=ModelConfig.from_server_args(args), get_model=lambda: model
        )
        assert type(client) is ExpertBackupClient
        sock_recv(pull)  # SGLang's readiness message
        reply = BackupDramReq(rank=0, weight_pointer_map={}, session_id="none", buffer_size=0)
        deadline = time.monotonic() + 20
        while not client.use_backup and time.monotonic() < deadline:
            sock_send(pub, reply)  # PUB drops what a late subscriber misses: resend
            time.sleep(0.1)
        assert client.use_backup
        client._receive_thread.join(timeout=20)  # SGLang's registration of every parameter
        assert not client._receive_thread.is_alive()


def test_every_expert_has_one_holder_node() -> None:
    from sglang_storage_adapters.elastic_ep import node_slice

    for experts, nodes in ((256, 3), (4, 1), (10, 4), (3, 3)):
        held = [e for node in range(nodes) for e in node_slice(experts, nodes, node)]
        assert held == list(range(experts)), (experts, nodes)  # SGLang's slicing drops E % n
    assert node_slice(10, 4, 1) == range(2, 4)  # SGLang's E // nnodes per node
