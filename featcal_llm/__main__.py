from featcal_llm.cli import main

main()
