from gpuaas.cli.main import main

main()
