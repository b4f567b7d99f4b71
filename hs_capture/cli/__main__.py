from hs_capture.cli import main

main()
