// MORPH_API marks what libmorph exports: the declarations of the public headers under
// include/morph/. The library is built with hidden visibility and a version script
// (runtime/api/libmorph.map), so nothing else leaves it; symbols_test lists what does.
#ifndef MORPH_API_H_
#define MORPH_API_H_

#if defined(__GNUC__)
// The standard attribute syntax, so that it combines with [[nodiscard]] in any position.
#define MORPH_API [[gnu::visibility("default")]]
#else
#define MORPH_API
#endif

#endif  // MORPH_API_H_
