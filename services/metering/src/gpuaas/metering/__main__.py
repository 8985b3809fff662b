from gpuaas.kit.cli import main
from gpuaas.metering.app import SPEC

if __name__ == "__main__":
    main(SPEC)
