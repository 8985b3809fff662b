from gpuaas.app_runtime.app import SPEC
from gpuaas.kit.cli import main

if __name__ == "__main__":
    main(SPEC)
