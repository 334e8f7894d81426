// MORPH_API marks what libmorph exports: the declarations of the public headers under
// include/morph/. The library is built with hidden visibility and a version script
// (runtime/api/libmorph.map), so nothing else leaves it; symbols_test lists what does.
#ifndef MORPH_API_H_
#define MORPH_API_H_

#if defined(__GNUC__)
#define MORPH_API __attribute__((visibility("default")))
#else
#define MORPH_API
#endif

#endif  // MORPH_API_H_
