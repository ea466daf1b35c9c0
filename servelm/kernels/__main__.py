from servelm.kernels import main

raise SystemExit(main())
