from hotggml.cli import main

raise SystemExit(main())
