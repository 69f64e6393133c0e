"""The layouts a cluster of GPUs allows: TP inside a node (or across whole nodes), PP across
nodes, as many replicas as the GPUs hold; each checked against the model's shape and memory.

A pipeline's stages sit on different nodes (the layout the paper measures and the Helm chart's
`stage.antiAffinity: required`), so activations between stages cross the inter-node link. With
TP below a node's GPU count, several replicas share nodes (one stage of each per node)."""

from __future__ import annotations

from dataclasses import dataclass

from controller.simulator import Deployment, ModelSpec, get_gpu, get_link

HELM_MAX_TP = 8
"""The chart runs a stage as one pod of tp workers: a stage cannot span nodes there."""


@dataclass(frozen=True)
class ClusterSpec:
    """What a user has: a model on num_gpus GPUs of one type, gpus_per_node of them per node."""

    model: ModelSpec
    gpu: str
    num_gpus: int
    gpus_per_node: int
    link: str = "eth-100g"
    """Between nodes."""
    tp_link: str = "nvlink"
    """Between the GPUs of one node."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node "
                f"({self.gpus_per_node}): whole nodes"
            )
        get_gpu(self.gpu), get_link(self.link), get_link(self.tp_link)  # names checked here

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    nodes_per_stage: int = 1
    """Nodes one TP group spans (its all-reduces then cross the inter-node link)."""

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        across = f" ({self.nodes_per_stage} nodes)" if self.nodes_per_stage > 1 else ""
        return f"TP{self.tp}{across}-PP{self.pp}"

    @property
    def helm_deployable(self) -> bool:
        """The chart holds a stage in one pod on one node, at most 8 GPUs."""
        return self.nodes_per_stage == 1 and self.tp <= HELM_MAX_TP

    def replicas_on(self, cluster: ClusterSpec) -> int:
        """How many pipelines the cluster holds, each stage of one pipeline on its own node(s)."""
        if self.nodes_per_stage > 1:
            return cluster.num_nodes // (self.nodes_per_stage * self.pp)
        stage_slots = cluster.num_nodes * (cluster.gpus_per_node // self.tp)
        return stage_slots // self.pp if self.pp <= cluster.num_nodes else 0


def _powers_of_two_up_to(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def candidate_shapes(cluster: ClusterSpec) -> list[Layout]:
    """Every (TP, PP) that fits the node and GPU counts, before the model's constraints."""
    gpn, nodes = cluster.gpus_per_node, cluster.num_nodes
    shapes = [Layout(tp, 1) for tp in _powers_of_two_up_to(gpn) if gpn % tp == 0]
    shapes += [Layout(gpn * k, 1, k) for k in _powers_of_two_up_to(nodes) if k > 1]
    layouts = []
    for shape in shapes:
        for pp in range(1, nodes // shape.nodes_per_stage + 1):
            layout = Layout(shape.tp, pp, shape.nodes_per_stage)
            if layout.replicas_on(cluster) >= 1:
                layouts.append(layout)
    return layouts


def deployment_of(
    cluster: ClusterSpec, layout: Layout, max_batch_tokens: int, min_kv_tokens: int
) -> Deployment:
    """The cost model's view of one replica; ValueError says why the layout cannot hold it."""
    return Deployment(
        model=cluster.model,
        gpu=get_gpu(cluster.gpu),
        tp=layout.tp,
        pp=layout.pp,
        stage_link=get_link(cluster.link),
        tp_link=get_link(cluster.tp_link),
        nodes_per_stage=layout.nodes_per_stage,
        max_batch_tokens=max_batch_tokens,
        min_kv_tokens=min_kv_tokens,
    )


def feasible_layouts(
    cluster: ClusterSpec, max_batch_tokens: int, min_kv_tokens: int
) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Layouts whose shape the model divides into and whose memory holds it, and the others
    with the reason (layers not divisible, heads not divisible, weights too large)."""
    fit: list[Layout] = []
    rejected: list[tuple[Layout, str]] = []
    for layout in candidate_shapes(cluster):
        try:
            deployment_of(cluster, layout, max_batch_tokens, min_kv_tokens)
        except ValueError as err:
            rejected.append((layout, str(err)))
        else:
            fit.append(layout)
    return fit, rejected
