from gpuaas.catalog.app import SPEC
from gpuaas.kit.cli import main

if __name__ == "__main__":
    main(SPEC)
