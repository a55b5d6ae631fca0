from flexpipe.cli import main

main()
