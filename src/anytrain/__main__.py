from anytrain.cli import main

main()
