"""The example controller of docs/app-controllers.md: `gpuaas-controller run echo_controller:EchoController`."""

from echo_controller.controller import MANIFEST, EchoController

__all__ = ["MANIFEST", "EchoController"]
