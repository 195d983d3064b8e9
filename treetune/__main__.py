from treetune.cli import main

main()
