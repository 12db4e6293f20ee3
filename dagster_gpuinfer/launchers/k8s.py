"""`K8sLauncher`: the worker in a GPU pod, or a pod group for a spec with `nodes > 1`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg

from dagster_gpuinfer.k8s.config import K8sLauncherConfig
from dagster_gpuinfer.k8s.group import GroupConfig
from dagster_gpuinfer.spec import InferenceSpec


class K8sLauncher:
    """`Launcher`: one pod (`k8s.client.run_k8s_worker`) or one pod group
    (`k8s.group_launch.run_k8s_group`), both from the same per-run pod configuration."""

    def __init__(
        self,
        *,
        config: K8sLauncherConfig,
        group_config: GroupConfig,
        env: Mapping[str, str],
        kubernetes_client: Callable[[], Any],
    ) -> None:
        self.config = config
        self.group_config = group_config
        self.env = dict(env)
        self.kubernetes_client = kubernetes_client

    def launch(
        self,
        *,
        context: dg.AssetExecutionContext,
        spec: InferenceSpec,
        extras: Mapping[str, Any],
        launch_attempt: int = 0,
    ) -> list[Any]:
        if spec.nodes > 1:
            from dagster_gpuinfer.k8s.group_launch import run_k8s_group

            return run_k8s_group(
                context=context,
                spec=spec,
                extras=dict(extras),
                config=self.config,
                group_config=self.group_config,
                env=self.env,
                kubernetes_client=self.kubernetes_client,
                launch_attempt=launch_attempt,
            )
        from dagster_gpuinfer.k8s.client import run_k8s_worker

        return run_k8s_worker(
            context=context,
            spec=spec,
            extras=dict(extras),
            config=self.config,
            env=self.env,
            kubernetes_client=self.kubernetes_client,
            launch_attempt=launch_attempt,
        )
