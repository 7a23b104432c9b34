from deqbench.cli import main

main()
