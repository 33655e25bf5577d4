from broker.cli.app import main

main()
