from raytp.cli import main

main()
