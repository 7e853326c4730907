from moetplan.cli import main

main()
